"""Hub ids: model.target / draft.model as `org/name[@revision]`, served by a stand-in Hub on loopback
(tests/support/stand_in_hub.py) reached the way HF_ENDPOINT reaches it. Two nodes with separate caches; the
server's own log says which files and bytes each fetched: rank 0 the small files, the embeddings' and
layers [0, split)'s bytes and the drafter; rank 1 the small files, layers [split, L)'s bytes, the norm
and (tied embeddings) the embedding matrix as its head; nothing else. Output equals generate."""
import hashlib
import json
import re
import shutil
import struct
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from model_parallel.hub import HubError, fetch_stage, resolve
from model_parallel.loader import ModelLoadError, load_stage
from tests.support.stand_in_hub import Hostile, StandInHub
from tests.support.tiny_models import ids_arg, reference_greedy, run_pair, run_tandem, save_tiny, save_tiny_tokenizer

PROMPT = [11, 42, 7, 250, 3, 99, 180, 5, 42, 7]
MAX_NEW = 12
SMALL = {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"}


def sharded(src: Path, dest: Path, shard_size: str | None) -> Path:
    """The model saved again in shards of about `shard_size` (None: one model.safetensors), with a tokenizer."""
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(dest, **({"max_shard_size": shard_size} if shard_size else {}))
    save_tiny_tokenizer(dest)
    return dest


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub-repos")
    return {  # llama: tied embeddings, so rank 1 needs the embedding matrix for its head
        "main": sharded(save_tiny(root / "a", "llama", seed=2), root / "main", "100KB"),
        "v2": sharded(save_tiny(root / "b", "llama", seed=5), root / "v2", "100KB"),
        "draft": sharded(save_tiny(root / "c", "llama", seed=2, layers=2), root / "draft", None),  # unsharded
    }


@pytest.fixture
def hub(repos, monkeypatch):
    with StandInHub({"org/tiny": {"main": repos["main"], "v2": repos["v2"]}, "org/draft": {"main": repos["draft"]}}) as server:
        # what HF_ENDPOINT sets when huggingface_hub is imported (this process imported it already)
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        yield server


def stage_tensors(rank: int, split: int = 2, layers: int = 4) -> set[str]:
    """Written from the issue, not from the loader: what each rank of a tied llama runs."""
    first, last = (0, split) if rank == 0 else (split, layers)
    keys = [f"model.layers.{i}." for i in range(first, last)]
    extra = {"model.embed_tokens.weight"} | ({"model.norm.weight"} if rank == 1 else set())
    return lambda name: name in extra or name.startswith(tuple(keys))


def expected_bytes(folder: Path, wanted) -> dict[str, int]:
    """file -> header + the wanted tensors' bytes, for every shard that holds one of them (read from the
    origin's own files)."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        raw = file.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        mine = [v["data_offsets"] for k, v in header.items() if k != "__metadata__" and wanted(k)]
        if mine:
            out[file.name] = 8 + n + sum(b - a for a, b in mine)
    return out


def args(target: str, cache: Path, *extra: str) -> list[str]:
    return [f"model.target={target}", f"model.hub_cache={cache}", "model.dtype=float32", "model.split=2",
            f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}", *extra]


def two_nodes(tmp_path, target: str, *extra: str) -> dict:
    return run_pair(*args(target, tmp_path / "node0", *extra), rank1=(f"model.hub_cache={tmp_path / 'node1'}",))


def test_two_nodes_fetch_only_their_share_then_nothing_then_run_offline(hub, repos, tmp_path, monkeypatch, capsys):
    drafter = ("draft.kind=model", "draft.model=org/draft", "draft.dtype=float32", "spec.k=3")
    out = two_nodes(tmp_path, "org/tiny", *drafter)
    assert out["token_ids"] == reference_greedy(repos["main"], PROMPT, MAX_NEW)
    weights = {f"rank{r}": {f: n for f, n in hub.fetched(f"rank{r}").items() if f.endswith(".safetensors")} for r in (0, 1)}
    for rank in (0, 1):
        fetched = hub.fetched(f"rank{rank}")
        small = {f for f in fetched if not f.endswith(".safetensors")}
        assert small == SMALL, small
        target_bytes = {f: n for f, n in weights[f"rank{rank}"].items() if f.startswith("model-")}
        assert target_bytes == expected_bytes(repos["main"], stage_tensors(rank))
    # the drafter is rank 0's alone, and rank 1 asked nothing of it
    assert weights["rank0"]["model.safetensors"] == (repos["draft"] / "model.safetensors").stat().st_size
    assert not [e for e in hub.log if e.repo == "org/draft" and e.client == "rank1"]
    # the split runs through a shard: both nodes fetched their own byte ranges of it, neither the whole file
    shared = set(weights["rank0"]) & set(weights["rank1"]) - {"model.safetensors"}
    assert any(max(weights["rank0"][f], weights["rank1"][f]) < (repos["main"] / f).stat().st_size for f in shared)
    checkpoint = sum(p.stat().st_size for p in repos["main"].glob("*.safetensors"))
    with capsys.disabled():  # the figure for the notes
        print(f"\nfetched of the {checkpoint} B checkpoint: rank 0 {sum(v for f, v in weights['rank0'].items() if f.startswith('model-'))} B, "
              f"rank 1 {sum(weights['rank1'].values())} B")
    err = capsys.readouterr().err
    assert "model.target: org/tiny from the Hub (commit" in err and "of the checkpoint's" in err

    before = len(hub.log)  # a second launch: the small files are cached, every range is present
    assert two_nodes(tmp_path, "org/tiny", *drafter)["token_ids"] == out["token_ids"]
    assert not [e for e in hub.log[before:] if e.file is not None and e.method == "GET"]
    assert "fetched 0 B now" in capsys.readouterr().err

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1
    before = len(hub.log)
    assert two_nodes(tmp_path, "org/tiny", *drafter)["token_ids"] == out["token_ids"]
    assert hub.log[before:] == []


def test_an_auto_split_is_settled_before_any_weight_is_fetched(hub, repos, tmp_path, capsys):
    """model.split=auto: each rank works out its bytes and times itself from config.json alone, the
    handshake settles the split, and only then does each node fetch, exactly the share of that split."""
    out = run_pair(*[a for a in args("org/tiny", tmp_path / "node0", "draft.kind=none") if a != "model.split=2"],
                   "model.split=auto", rank1=(f"model.hub_cache={tmp_path / 'node1'}",))
    assert out["token_ids"] == reference_greedy(repos["main"], PROMPT, MAX_NEW)
    split = int(re.search(r"\[rank 1: layers (\d+)-", capsys.readouterr().err)[1])
    for rank in (0, 1):
        fetched = {f: n for f, n in hub.fetched(f"rank{rank}").items() if f.startswith("model-")}
        assert fetched == expected_bytes(repos["main"], stage_tensors(rank, split))


def test_a_revision_is_its_own_model(hub, repos, tmp_path):
    v2 = reference_greedy(repos["v2"], PROMPT, MAX_NEW)
    assert v2 != reference_greedy(repos["main"], PROMPT, MAX_NEW)  # the revisions really differ
    assert two_nodes(tmp_path / "tag", "org/tiny@v2", "draft.kind=none")["token_ids"] == v2
    commit = hub.commits["org/tiny"]["v2"]
    assert two_nodes(tmp_path / "commit", f"org/tiny@{commit}", "draft.kind=none")["token_ids"] == v2


def test_offline_with_a_range_missing_names_the_file_and_the_id(hub, repos, tmp_path, monkeypatch):
    folder, _ = resolve("org/tiny", "model.target", str(tmp_path), 1)
    fetch_stage(folder, 2, 4, embed=False, head=True, rank=1)  # rank 1 of split 2 ran once online
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    fetch_stage(folder, 3, 4, embed=False, head=True, rank=1)  # a subset: fine offline
    with pytest.raises(HubError) as caught:
        fetch_stage(folder, 1, 4, embed=False, head=True, rank=1)  # layer 1 was never fetched here
    message = str(caught.value)
    layer1 = {f for f, n in expected_bytes(repos["main"], lambda k: k.startswith("model.layers.1.")).items()}
    assert "\n" not in message and "org/tiny" in message and any(f in message for f in layer1), message
    with pytest.raises(HubError) as caught:
        resolve("org/never-fetched", "model.target", str(tmp_path), 0)
    assert "\n" not in str(caught.value) and "org/never-fetched" in str(caught.value) and "offline" in str(caught.value)


def test_an_interrupted_fetch_resumes_where_it_stopped(repos, tmp_path, monkeypatch):
    share = expected_bytes(repos["main"], stage_tensors(1))
    with StandInHub({"org/tiny": {"main": repos["main"]}}, fail_after_bytes=sum(share.values()) // 2) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        folder, _ = resolve("org/tiny", "model.target", str(tmp_path), 1)
        with pytest.raises(HubError, match="interrupted|sent"):
            fetch_stage(folder, 2, 4, embed=False, head=True, rank=1)
        fetch_stage(folder, 2, 4, embed=False, head=True, rank=1)
        fetched = {f: n for f, n in server.fetched("rank1").items() if f.endswith(".safetensors")}
    # no byte of the share twice (progress recorded as it streams in), and every byte of it in the end
    assert fetched == share
    stage = load_stage(folder, 2, 4, embed=False, head=True)
    origin = {}
    for file in repos["main"].glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            origin.update({k: f.get_tensor(k) for k in f.keys()})
    assert torch.equal(stage.layers[0].mlp.up_proj.weight, origin["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(stage.head.weight, origin["model.embed_tokens.weight"])


def test_a_gated_model_needs_hf_token_and_every_request_carries_it(repos, tmp_path, monkeypatch):
    with StandInHub({"org/tiny": {"main": repos["main"]}}, token="hf_secret") as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.delenv("HF_TOKEN", raising=False)
        with pytest.raises(HubError) as caught:
            resolve("org/tiny", "model.target", str(tmp_path / "without"), 1)
        assert "\n" not in str(caught.value) and "HF_TOKEN" in str(caught.value) and "org/tiny" in str(caught.value)
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        denied = len([e for e in server.log if e.method == "DENIED"])
        folder, _ = resolve("org/tiny", "model.target", str(tmp_path / "with"), 1)
        fetch_stage(folder, 2, 4, embed=False, head=True, rank=1)
        assert len([e for e in server.log if e.method == "DENIED"]) == denied  # the byte ranges too
        assert server.fetched("rank1").keys() >= expected_bytes(repos["main"], stage_tensors(1)).keys()


def test_an_existing_local_folder_wins_over_a_hub_id(repos, tmp_path, monkeypatch):
    local = tmp_path / "org" / "tiny"
    local.parent.mkdir()
    local.symlink_to(repos["v2"])
    monkeypatch.chdir(tmp_path)
    folder, line = resolve("org/tiny", "model.target", str(tmp_path / "cache"), 0)
    assert folder == "org/tiny" and "local folder" in line and not (tmp_path / "cache").exists()


@pytest.mark.slow  # a torchrun launch of 6-10 s: the default suite keeps under 5 minutes
def test_torchrun_reads_the_hub_environment(hub, repos, tmp_path):
    """The real entry under torchrun, configured only by huggingface_hub's environment: HF_ENDPOINT to the
    stand-in, HF_HUB_CACHE to one cache both ranks of this host share (each adds its ranges in turn)."""
    cache = tmp_path / "hf-cache"
    out, proc = run_tandem(tmp_path, "model.target=org/tiny", "model.dtype=float32", "model.split=2", "draft.kind=none",
                           f"prompt_ids={ids_arg(PROMPT)}", f"gen.max_new_tokens={MAX_NEW}",
                           env={"HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    assert out["token_ids"] == reference_greedy(repos["main"], PROMPT, MAX_NEW)
    assert "model.target: org/tiny from the Hub" in proc.stderr
    # one cache, both shares: what the two ranks fetched adds up to their shares, each byte once
    shares = [expected_bytes(repos["main"], stage_tensors(r)) for r in (0, 1)]
    fetched = {f: n for f, n in hub.fetched("rank0").items() if f.startswith("model-")}
    for f, n in hub.fetched("rank1").items():
        if f.startswith("model-"):
            fetched[f] = fetched.get(f, 0) + n
    headers = {f: 8 + struct.unpack("<Q", (repos["main"] / f).read_bytes()[:8])[0] for f in fetched}
    union = {f: shares[0].get(f, 0) + shares[1].get(f, 0) - (headers[f] if f in shares[0] and f in shares[1] else 0)
             for f in fetched}
    embed = expected_bytes(repos["main"], lambda k: k == "model.embed_tokens.weight")  # both ranks need it
    for f, n in embed.items():
        union[f] -= n - headers[f]
    assert fetched == union
    assert any(cache.glob("models--org--tiny/tandem/*/model-*.safetensors.ranges.json"))


# --- a hostile or broken Hub: nothing that arrives is trusted (issue 25) ----------------------------

@contextmanager
def lying_hub(monkeypatch, repo: Path, **lies):
    """The stand-in serving `repo` as org/x, lying as `lies` says (see tests.support.stand_in_hub.Hostile)."""
    with StandInHub({"org/x": {"main": repo}}, hostile=Hostile(**lies)) as server:
        monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        yield server


def fetch_all(cache: Path, layers: int = 2) -> str:
    """Resolve org/x and fetch every tensor of it, as rank 0 of a one-stage run would."""
    folder, _ = resolve("org/x", "model.target", str(cache), 0)
    fetch_stage(folder, 0, layers, embed=True, head=True, rank=0)
    return folder


def refused(error: pytest.ExceptionInfo, *words: str) -> str:
    message = str(error.value)
    assert "\n" not in message and all(w in message for w in words), message
    return message


def test_a_range_with_flipped_bytes_is_refused_once_the_shard_is_whole(repos, tmp_path, monkeypatch):
    with lying_hub(monkeypatch, repos["draft"], flip_data=True) as server:
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
        assert any(e.start > 8 for e in server.log if e.file == "model.safetensors")  # tensor bytes did arrive
    refused(caught, "model.safetensors", "org/x", "sha256", "altered in transit", "run again")
    kept = [p.name for p in tmp_path.glob("models--org--x/tandem/*/model.safetensors*") if p.suffix != ".lock"]
    assert kept == []  # the altered bytes are not kept


def test_a_partial_shard_records_the_commit_and_sha256_its_ranges_came_with(hub, repos, tmp_path):
    folder, _ = resolve("org/tiny", "model.target", str(tmp_path), 1)
    fetch_stage(folder, 2, 4, embed=False, head=True, rank=1)
    records = {p.name.removesuffix(".ranges.json"): json.loads(p.read_text()) for p in Path(folder).glob("*.ranges.json")}
    assert records
    for file, record in records.items():
        assert record["commit"] == hub.commits["org/tiny"]["main"]
        assert record["etag"] == hashlib.sha256((repos["main"] / file).read_bytes()).hexdigest()


def test_a_range_of_another_file_version_is_refused_and_the_shard_dropped(repos, tmp_path, monkeypatch):
    with lying_hub(monkeypatch, repos["main"], etag_per_range=True):
        folder, _ = resolve("org/x", "model.target", str(tmp_path), 1)
        with pytest.raises(HubError) as caught:
            fetch_stage(folder, 2, 4, embed=False, head=True, rank=1)
    refused(caught, "org/x", "changed on the server", "fetch again")
    assert [p.name for p in Path(folder).glob("model-*.safetensors*") if p.suffix != ".lock"] == []


@pytest.mark.parametrize("length, words", [(2 ** 40, "over safetensors' limit of 100,000,000"),
                                           (100_000_001, "over safetensors' limit"),
                                           (10 ** 6, "past the file's end")])
def test_a_header_length_past_the_limit_or_the_file_is_refused_before_it_is_asked_for(repos, tmp_path, monkeypatch,
                                                                                     length, words):
    with lying_hub(monkeypatch, repos["draft"], header_length=length) as server:
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
        assert server.ranges("rank0", "model.safetensors") == [(0, 8)]
    message = refused(caught, "model.safetensors", "org/x", f"{length:,}", words, "broken, not the network")
    assert "resume" not in message


def test_a_header_that_is_not_json_is_the_checkpoints_fault_in_one_line(repos, tmp_path, monkeypatch):
    with lying_hub(monkeypatch, repos["draft"], bad_json_header=True) as server:
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
        header_end = 8 + struct.unpack("<Q", (repos["draft"] / "model.safetensors").read_bytes()[:8])[0]
        assert max(b for _, b in server.ranges("rank0", "model.safetensors")) <= header_end  # no tensor byte
    assert "resume" not in refused(caught, "model.safetensors", "not valid JSON", "broken, not the network")


@pytest.mark.parametrize("entry, words", [({"data_offsets": [0, 10 ** 12]}, "outside the file"),
                                          ({"data_offsets": [-8, 4]}, "outside the file"),
                                          ({"data_offsets": [8, 4]}, "outside the file"),
                                          ({"data_offsets": "0-4"}, "not two integers"),
                                          ({"data_offsets": [0, 3]}, "(3 bytes) for F32"),  # not the shape's bytes
                                          ({"shape": [-1, 16]}, "not a list of non-negative"),
                                          ({"shape": [10 ** 9]}, "for F32 [1000000000]"),
                                          ({"dtype": "F128"}, "dtype 'F128'")])
def test_a_tensor_entry_outside_the_file_or_its_shape_is_refused_before_any_tensor_byte(repos, tmp_path, monkeypatch,
                                                                                       entry, words):
    with lying_hub(monkeypatch, repos["draft"], tensor_entries={"model.norm.weight": entry}) as server:
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
        raw = server.hostile.content("model.safetensors", (repos["draft"] / "model.safetensors").read_bytes())
        header_end = 8 + struct.unpack("<Q", raw[:8])[0]
        assert max(b for _, b in server.ranges("rank0", "model.safetensors")) <= header_end
    assert "resume" not in refused(caught, "model.safetensors", "'model.norm.weight'", words, "broken, not the network")


HOSTILE_NAMES = ["../../x.safetensors", "/tmp/tandem-abs.safetensors", "sub/x.safetensors", "sub\\x.safetensors",
                 "..", "config.json", "x.safetensors\0"]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_a_weight_map_naming_a_file_outside_the_repo_is_refused_from_the_hub(repos, tmp_path, monkeypatch, name):
    with lying_hub(monkeypatch, repos["main"], weight_map={"model.norm.weight": name}):
        with pytest.raises(ModelLoadError) as caught:
            fetch_all(tmp_path / "cache", layers=4)
    refused(caught, "weight_map entry 'model.norm.weight'", repr(name), "not a plain")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"] and not Path("/tmp/tandem-abs.safetensors").exists()


@pytest.mark.parametrize("name", HOSTILE_NAMES[:3])
def test_a_weight_map_naming_a_file_outside_the_folder_is_refused_locally(repos, tmp_path, name):
    local = tmp_path / "model"
    shutil.copytree(repos["main"], local)
    index = json.loads((local / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = name
    (local / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError) as caught:
        load_stage(local, 2, 4, embed=False, head=True)
    refused(caught, "weight_map entry 'model.norm.weight'", repr(name), "not a plain")


def test_a_damaged_whole_shard_in_the_standard_cache_is_refused(hub, repos, tmp_path):
    from huggingface_hub import hf_hub_download
    blob = Path(hf_hub_download("org/draft", "model.safetensors", cache_dir=str(tmp_path))).resolve()
    folder = fetch_draft = resolve("org/draft", "draft.model", str(tmp_path), 0)[0]
    fetch_stage(fetch_draft, 0, 2, embed=True, head=True, rank=0)  # intact: linked, nothing fetched
    assert not hub.ranges("rank0", "model.safetensors")
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0x80
    blob.chmod(0o644)
    blob.write_bytes(bytes(raw))
    with pytest.raises(HubError) as caught:
        fetch_stage(folder, 0, 2, embed=True, head=True, rank=0)
    refused(caught, "model.safetensors", "org/draft", "huggingface_hub's cache", "damaged")


# --- the whole-shard digest: compared in full, over the whole file (issue 39) -----------------------
MIB = 2 ** 20


@pytest.fixture(scope="module")
def big_repo(tmp_path_factory):
    """An unsharded tiny llama whose model.safetensors is over 8 MiB (a 36,000-token embedding): the digest
    must cover the bytes past the first 8 MiB (file_digest reads in 8 MiB pieces)."""
    folder = save_tiny(tmp_path_factory.mktemp("big") / "big", "llama", seed=3, layers=2, seed_vocab=36_000)
    assert (folder / "model.safetensors").stat().st_size > 8 * MIB + 64 * 1024
    return folder


def test_an_honest_shard_over_8_mib_is_hashed_to_its_end_and_taken(big_repo, tmp_path, monkeypatch):
    with lying_hub(monkeypatch, big_repo):  # no lie
        folder = fetch_all(tmp_path)
    record = json.loads((Path(folder) / "model.safetensors.ranges.json").read_text())
    truth = hashlib.sha256((big_repo / "model.safetensors").read_bytes()).hexdigest()
    assert record["verified"] == ["sha256", truth]
    assert (Path(folder) / "model.safetensors").read_bytes() == (big_repo / "model.safetensors").read_bytes()


def test_a_byte_past_the_first_8_mib_altered_in_transit_is_refused(big_repo, tmp_path, monkeypatch):
    at = 8 * MIB + 4096
    with lying_hub(monkeypatch, big_repo, flip_byte_at=at) as server:
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
        assert any(a <= at < b for a, b in server.ranges("rank0", "model.safetensors"))  # the altered byte did arrive
    refused(caught, "model.safetensors", "org/x", "sha256", "altered in transit", "run again")
    assert [p.name for p in tmp_path.glob("models--org--x/tandem/*/model.safetensors*") if p.suffix != ".lock"] == []


def test_a_fetched_shard_whose_digest_differs_only_in_its_last_hex_digit_is_refused(repos, tmp_path, monkeypatch):
    """The tree and the ETags agree on a digest that is the file's own but for its last hex digit: a compare
    of any prefix of the digest takes the file, the full compare refuses it."""
    with lying_hub(monkeypatch, repos["draft"], digest_off_by_last_hex=True):
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
    refused(caught, "model.safetensors", "org/x", "sha256", "run again")


def test_a_cached_shard_whose_digest_differs_only_in_its_last_hex_digit_is_refused(repos, tmp_path, monkeypatch):
    from huggingface_hub import hf_hub_download
    with lying_hub(monkeypatch, repos["draft"], digest_off_by_last_hex=True):
        hf_hub_download("org/x", "model.safetensors", cache_dir=str(tmp_path))  # whole in huggingface_hub's cache
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
    refused(caught, "model.safetensors", "org/x", "huggingface_hub's cache", "damaged")


def test_a_cached_shard_over_8_mib_damaged_past_8_mib_is_refused(big_repo, tmp_path, monkeypatch):
    from huggingface_hub import hf_hub_download
    with lying_hub(monkeypatch, big_repo):
        blob = Path(hf_hub_download("org/x", "model.safetensors", cache_dir=str(tmp_path))).resolve()
        fetch_all(tmp_path)  # intact: taken as it is
        raw = bytearray(blob.read_bytes())
        raw[8 * MIB + 4096] ^= 0x01
        blob.chmod(0o644)
        blob.write_bytes(bytes(raw))
        with pytest.raises(HubError) as caught:
            fetch_all(tmp_path)
    refused(caught, "model.safetensors", "org/x", "huggingface_hub's cache", "damaged")
