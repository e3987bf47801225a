"""Engine-, data- and model-agnostic building blocks: types, registry, seeding, round loop, checkpoints."""
