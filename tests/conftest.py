import os

import pytest

# Tests run on CPU with few threads so that timings and results do not depend on the machine.
os.environ.setdefault("OMP_NUM_THREADS", "2")

FASHION_DIR = "/usr/share/datasets/fashion-mnist"


@pytest.fixture
def requires_fashion_mnist():
    if not os.path.exists(os.path.join(FASHION_DIR, "train-images-idx3-ubyte.gz")):
        pytest.skip("Fashion-MNIST absent: apt-get install -y dataset-fashion-mnist")
