"""Issue 28: serving telemetry while several requests are live. Their rounds come interleaved: TensorBoard's
round/* keep one step per round across the serve (no two rounds on one step), serve/slots_in_use goes with
them, request/* carry TTFT, queue time and tokens/s; trace.json tags every span with its slot and request
and puts each slot on rows of its own. Synthetic rounds (no model): milliseconds."""
import json
from types import SimpleNamespace

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from launch.config import load_config
from launch.telemetry import ServeTelemetry
from launch.timeline import SLOT_ROWS
from speculative.output import Output
from speculative.rounds import Generation, RoundRecord

ROUND_S = 0.010  # each request's rounds: one every 10 ms, 2 ms on the way out and 2 back, 4 ms at rank 1


def request_rounds(t0: float, rounds: int) -> tuple[Generation, list[list[float]]]:
    """A generation of `rounds` rounds starting at `t0` (perf_counter seconds), and rank 1's readings of them
    (one clock: the true offset is 0)."""
    gen = Generation([1, 2, 3], Output(None, set(), rounds, []), t0_s=t0, total_s=rounds * ROUND_S)
    marks = []
    for i in range(rounds):
        gen.rounds.append(RoundRecord(2, 1, 2, 1.0, 1.0, round_ms=8.0, last_ms=4.0, start_s=i * ROUND_S,
                                      send_ms=0.1, sent_s=i * ROUND_S + 0.002, in_flight=2, on_the_way=2))
        sent = t0 + i * ROUND_S + 0.002
        marks.append([sent - 0.001, sent + 0.002, sent + 0.005, sent + 0.006])
    return gen, marks


def test_interleaved_requests_keep_their_own_figures_steps_and_rows(tmp_path):
    cfg = load_config(["serve.port=1", f"log.dir={tmp_path}", "log.trace=true"])
    telemetry = ServeTelemetry(cfg)
    # two requests live at once: request 0 in slot 1 (4 rounds), request 1 in slot 0 (3 rounds), 5 ms apart
    (gen_a, marks_a), (gen_b, marks_b) = request_rounds(100.0, 4), request_rounds(100.005, 3)
    order = [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (0, 3)]  # (request, round) as the replies came
    for request, i in order:
        gen, marks = (gen_a, marks_a) if request == 0 else (gen_b, marks_b)
        reply = SimpleNamespace(marks=marks[i], middle_marks=None)
        telemetry.on_round(gen.rounds[i], reply, request, live=2 if (request, i) != (0, 3) else 1, waiting=1)
    for index, (request, gen, slot) in enumerate(((1, gen_b, 0), (0, gen_a, 1))):
        stats = {"ttft_s": 0.5 + index, "queue_s": 0.25 + index, "tokens_per_s": 10.0 * (index + 1), "tokens": 4,
                 "prompt_tokens": 3, "prompt_tokens_reused": 0, "prefilled_tokens": 3, "slot": slot}
        telemetry.on_request(stats, index, request, gen)
    telemetry.close()

    run_dir, = tmp_path.iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    steps = [e.step for e in events.Scalars("round/tokens")]
    assert steps == list(range(len(order)))  # one step per round, across both requests
    assert [e.value for e in events.Scalars("serve/slots_in_use")] == [2] * 6 + [1]
    assert [e.value for e in events.Scalars("round/on_the_way")] == [2] * 7
    for tag, values in (("request/ttft_ms", [500, 1500]), ("request/queue_ms", [250, 1250]),
                        ("request/tokens_per_s", [10, 20]), ("request/slot", [0, 1])):
        assert [(e.step, e.value) for e in events.Scalars(tag)] == list(enumerate(values)), tag

    trace = json.loads((run_dir / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    rounds = [e for e in spans if e["pid"] == 0 and e["name"] == "round"]
    assert sorted(e["args"]["round"] for e in rounds) == list(range(7))  # numbered across the requests
    for e in spans:  # every span of rank 0 and rank 1 on its slot's rows, tagged with its request
        slot, request = e["args"]["slot"], e["args"]["request"]
        assert slot * SLOT_ROWS <= e["tid"] < (slot + 1) * SLOT_ROWS and e["dur"] >= 0, e
        assert (slot, request) in ((0, 0), (1, 1)), e
    for e in spans:  # rank 1 works on a round inside rank 0's window for it, whichever request it is
        if e["pid"] == 1 and e["name"] == "stage1":
            r = next(r for r in rounds if r["args"]["round"] == e["args"]["round"])
            assert r["args"]["slot"] == e["args"]["slot"] and r["ts"] <= e["ts"] <= r["ts"] + r["dur"], (r, e)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names[(0, 0)] == "slot 0" and names[(0, SLOT_ROWS)] == "slot 1" and names[(1, SLOT_ROWS)] == "slot 1"
    assert trace["otherData"]["clock_consistent"] and abs(trace["otherData"]["clock_offset_ms"]) < 1
