import pytest

from tests.support.tiny_models import save_tiny


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("qwen2") / "model", "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("llama") / "model", "llama", seed=2)


@pytest.fixture(scope="session")
def tiny_qwen_draft(tmp_path_factory):
    """Same vocabulary as tiny_qwen, different (random) weights: a drafter that is mostly wrong."""
    return save_tiny(tmp_path_factory.mktemp("qwen2-draft") / "model", "qwen2", seed=7, layers=2)
