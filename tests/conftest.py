import os

import pytest
import torch

# Tests use tiny models, for which one intra-op thread is fastest and immune to oversubscription
# (two cores shared with other processes make OpenMP spin-waits very slow). Subprocesses inherit it.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)

FASHION_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.fixture
def requires_fashion_mnist():
    if not os.path.exists(os.path.join(FASHION_DIR, "train-images-idx3-ubyte.gz")):
        pytest.skip("Fashion-MNIST absent: apt-get install -y dataset-fashion-mnist")


@pytest.fixture
def task_identity():
    """Messages need a run identity, which a Flower runtime normally sets."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    yield
    TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
