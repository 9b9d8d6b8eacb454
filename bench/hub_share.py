"""What each node fetches of a Hub checkpoint: a local model re-sharded into N files, served by the
tests' stand-in Hub on loopback, fetched by two nodes with separate caches for a given split.

    python -m bench.hub_share --shards 4 --split 14      # the embedded Qwen2.5-Coder-1.5B by default

Prints, per rank, the bytes fetched (from the server's own log) against the checkpoint's, and what a
per-shard downloader (whole files that hold any of the rank's tensors) would have fetched.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from huggingface_hub import constants, save_torch_state_dict, split_torch_state_dict_into_shards
from safetensors.torch import load_file

from transformers.core_model_loading import dot_natural_key

from model_parallel.hub import fetch_stage, resolve
from model_parallel.loader import load_config
from tests.support.stand_in_hub import StandInHub

EMBEDDED = Path("~/.cache/tandem/models/qwen2.5-coder-1.5b-instruct").expanduser()


def reshard(src: Path, dest: Path, shards: int) -> Path:
    dest.mkdir(parents=True)
    # in the model's own order (layer 2 before layer 10), as save_pretrained shards a checkpoint
    tensors = dict(sorted(load_file(src / "model.safetensors").items(), key=lambda kv: dot_natural_key(kv[0])))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    size = total // shards
    while len(split_torch_state_dict_into_shards(tensors, max_shard_size=size).filename_to_tensors) > shards:
        size = int(size * 1.02)  # huggingface_hub packs greedily: the smallest limit that gives `shards` files
    save_torch_state_dict(tensors, dest, max_shard_size=size)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(".safetensors"):
            shutil.copy(f, dest / f.name)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=EMBEDDED)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--split", type=int, default=None, help="rank 1's first layer (default: half)")
    args = parser.parse_args()
    layers = load_config(args.model).num_hidden_layers
    split = args.split or layers // 2
    with tempfile.TemporaryDirectory(dir=Path.home() / ".cache") as tmp:
        repo = reshard(args.model, Path(tmp) / "repo", args.shards)
        checkpoint = sum(f.stat().st_size for f in repo.glob("*.safetensors"))
        print(f"{args.model.name} in {len(list(repo.glob('*.safetensors')))} shards: {checkpoint / 1e6:.1f} MB; split {split} of {layers}")
        with StandInHub({"org/model": {"main": repo}}) as hub:
            constants.ENDPOINT = hub.endpoint
            constants.HUGGINGFACE_CO_URL_TEMPLATE = hub.endpoint + "/{repo_id}/resolve/{revision}/{filename}"
            for rank, (first, last) in enumerate([(0, split), (split, layers)]):
                folder, _ = resolve("org/model", "model.target", str(Path(tmp) / f"node{rank}"), rank)
                fetch_stage(folder, first, last, embed=rank == 0, head=rank == 1, rank=rank)
                sent = {f: n for f, n in hub.fetched(f"rank{rank}").items() if f.endswith(".safetensors")}
                whole_files = sum((repo / f).stat().st_size for f in sent)
                print(f"rank {rank} (layers {first}-{last - 1}{' + embeddings' if rank == 0 else ' + norm + head'}): "
                      f"fetched {sum(sent.values()) / 1e6:.1f} MB = {sum(sent.values()) / checkpoint:.1%} of the checkpoint, "
                      f"from {len(sent)} of the shards; whole shards would be {whole_files / 1e6:.1f} MB "
                      f"({whole_files / checkpoint:.0%})")


if __name__ == "__main__":
    main()
