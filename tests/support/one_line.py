"""What a user sees when Tandem stops for a reason it knows: one `tandem[rank N]: ...` line naming the
cause and the fix, never a traceback; checked on the exception (in process) and on a process's stderr."""
import re

import train_free_infer


def assert_one_line_error(error: BaseException, cls: type, *needles: str) -> None:
    """`error` is what the entry turns into one `tandem[rank N]: ...` line (no traceback), of type
    `cls`, on one line, naming every needle (the cause and the fix)."""
    assert isinstance(error, cls), repr(error)
    assert isinstance(error, train_free_infer.EXPECTED), f"{type(error).__name__} would reach the user as a traceback"
    message = str(error)
    assert "\n" not in message.strip(), message
    for needle in needles:
        assert needle in message, (needle, message)


# A frame of our own code in a traceback (torchrun prints its own agent's ChildFailedError report
# after a worker exits non-zero; that one is torchrun's, and comes after our line).
OUR_FRAME = re.compile(r'File "[^"]*(/launch/|/model_parallel/|/kvcache/|/speculative/|/netbridge/|train_free_infer\.py)')


def assert_one_line_process_error(proc, *needles):
    assert proc.returncode != 0
    assert not OUR_FRAME.search(proc.stderr), proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("tandem")]
    assert lines, proc.stderr[-3000:]
    for needle in needles:
        assert any(needle in line for line in lines), (needle, lines)
    return lines
