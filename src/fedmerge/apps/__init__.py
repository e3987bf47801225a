"""Entry points that other programs load: Flower's ServerApp and ClientApp."""
