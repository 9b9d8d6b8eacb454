"""Tokens/s of the embedded pair with and without a JSON schema (structured outputs), both ranks in this process
over an in-process channel (no network: what the grammar costs, not the wire).

    .venv/bin/python bench/structured_speed.py [--max-new 64] [--repeat 2] [extra key=value ...]

The same chat prompt is answered greedily three ways: free text, response_format json_object and json_schema
(the last rank masks at every verified position: speculative.verify with speculative.grammar). Per run: decode
tokens/s, tokens per round, the drafter's acceptance, the tokens. A second repeat is the figure (the first warms up).
Run it alone: a benchmark beside other work measures the other work.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

QUESTION = "Give the name, birth year and languages of Ada Lovelace as JSON."
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                         "languages": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "born", "languages"], "additionalProperties": False}


def main() -> None:
    import torch

    from launch.build import build_drafter, build_stage, eos_ids, load_tokenizer
    from launch.config import load_config
    from launch.ranks import last_rank, meet
    from netbridge.channel import local_pair
    from netbridge.protocol import SamplingParams
    from speculative.grammar import grammar_source
    from speculative.output import Output
    from speculative.session import Session
    from speculative.stats import summarize

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    args, extra = parser.parse_known_args()
    cfg = load_config(["output.stream=false", "prompt_ids=[1]", f"gen.max_new_tokens={args.max_new}", *extra])
    channels = local_pair(600.0)
    rank1 = threading.Thread(target=last_rank, args=(cfg, channels[1]), daemon=True)
    rank1.start()
    plan = meet(cfg, channels[0], channels[0], 0, 2)
    tokenizer = load_tokenizer(str(plan.models.target.folder))
    session = Session(build_stage(plan), build_drafter(plan), channels[0], plan.spec)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    kinds = {"text": None, "json_object": grammar_source({"type": "object"}), "json_schema": grammar_source(SCHEMA)}
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "target": plan.models.target.folder.name, "k": cfg.spec.k, "prompt_tokens": len(prompt)}))
    for repeat in range(args.repeat):
        for kind, grammar in kinds.items():
            output = Output(tokenizer, eos_ids(plan.models.target), args.max_new, [])
            session.scheduler.forget()  # every request prefills its whole prompt, as the first one does
            gen = session.generate(list(prompt), output, SamplingParams(grammar=grammar))
            stats = summarize(gen, cfg.spec.k, cfg.draft.kind)
            print(json.dumps({"repeat": repeat, "response_format": kind, "tokens": stats["tokens"],
                              "tokens_per_s": round(stats["tokens_per_s"], 2),
                              "tokens_per_round": round(stats["tokens_per_round"], 2),
                              "acceptance_rate": round(stats["acceptance_rate"], 3), "stop": stats["stop_reason"],
                              "text": output.text()[:160]}), flush=True)
    session.close()
    rank1.join(60)


if __name__ == "__main__":
    main()
