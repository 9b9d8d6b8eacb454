"""Nothing Tandem writes about a run holds a secret, and all of it is the user's alone (files 0600, folders
0700), whatever the umask: a run with every secret set, with telemetry, the trace and output.json."""
import os
import stat

from tests.support.tiny_models import ids_arg, run_pair

SECRETS = {"transport.secret": "pairing-5ecret-Zq81", "transport.relay_token": "relay-t0ken-Xv27",
           "serve.api_key": "api-k3y-Wm93"}


def test_no_secret_reaches_any_file_and_every_file_is_private(tiny_qwen, tmp_path):
    old = os.umask(0o022)  # a typical umask: what we create must not follow it
    try:
        out = tmp_path / "out" / "output.json"
        out.parent.mkdir()
        run_pair(f"model.target={tiny_qwen}", "model.dtype=float32", "draft.kind=ngram", "spec.k=3",
                 f"prompt_ids={ids_arg([5, 6, 7, 5, 6])}", "gen.max_new_tokens=6", f"log.dir={tmp_path / 'logs'}",
                 "log.profile=true", f"output.json={out}", *(f"{k}={v}" for k, v in SECRETS.items()))
    finally:
        os.umask(old)
    written = [p for p in [out, *(tmp_path / "logs").rglob("*")]]
    assert any(p.name.startswith("events.out.tfevents") for p in written) and any(p.name == "trace.json" for p in written)
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
        if path.is_file():
            data = path.read_bytes()
            for key, secret in SECRETS.items():
                assert secret.encode() not in data, f"{key} is in {path}"
    assert stat.S_IMODE((tmp_path / "logs").stat().st_mode) == 0o700
