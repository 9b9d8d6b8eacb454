import pytest

from tests.support.serve_harness import chat_folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, drafter): tiny qwen2 folders with a tokenizer and a chat template; the drafter mostly wrong."""
    root = tmp_path_factory.mktemp("chat-models")
    return chat_folder(root / "target", seed=1), chat_folder(root / "draft", seed=7, layers=2)
