"""Download from the hub, and convert from a repo id, against a real HTTP hub on 127.0.0.1.

The hub (tests/hub_server.py) serves a synthetic tiny gpt-oss checkpoint (HF layout + original/ +
a dummy metal/), a gated copy of it, and a repo with one 24 MiB shard for the resume test.
``HF_ENDPOINT`` points at it and ``HF_HOME`` at a per-test folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hub_server import HubServer
from huggingface_hub import constants as hf_constants
from typer.testing import CliRunner

from gptoss_fp8.checkpoint.hub import (
    CONVERTER_PATTERNS,
    ResolvedSource,
    download,
    parse_repo_spec,
    resolve_source,
    select_files,
)
from gptoss_fp8.cli.main import app
from gptoss_fp8.errors import GptOssFp8Error

REPO = "test-org/gpt-oss-tiny"
GATED = "test-org/gpt-oss-gated"
BIG = "test-org/big-shard"
GOOD_TOKEN = "hf_goodTokenAbcdefghijklmnop"  # has access to the gated repo
OTHER_TOKEN = "hf_otherTokenQrstuvwxyz012345"  # valid, but not granted the gated repo
BAD_TOKEN = "hf_unknownToken9876543210zyxw"  # the hub does not know it
BIG_SIZE = 24 * 1024 * 1024  # > huggingface_hub's 10 MiB write chunk, so a resume point exists


# --- fixtures ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    from gptoss_fp8.convert.synth import write_synthetic

    root = tmp_path_factory.mktemp("repo")
    write_synthetic(root, "tiny", layout="both")
    (root / "metal").mkdir()
    (root / "metal" / "model.bin").write_bytes(bytes(range(256)) * 16)
    (root / "README.md").write_text("# tiny synthetic gpt-oss\n")
    (root / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (root / "LICENSE").write_text("Apache-2.0\n")
    return root


@pytest.fixture(scope="module")
def big_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("big")
    (root / "config.json").write_text('{"model_type": "gpt_oss"}\n')
    (root / "model-00001-of-00001.safetensors").write_bytes(os.urandom(BIG_SIZE))
    return root


@pytest.fixture
def hub(tmp_path, monkeypatch, ckpt_dir, big_dir):
    """A running hub with the three repos; HF_* variables point at it and at a fresh HF_HOME."""
    with HubServer(tokens=(GOOD_TOKEN, OTHER_TOKEN), page_size=5) as server:  # small pages: pagination is used
        server.add_repo(REPO, ckpt_dir)
        server.add_repo(GATED, ckpt_dir, gated=True, allowed_tokens=(GOOD_TOKEN,))
        server.add_repo(BIG, big_dir)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(name, raising=False)
        # huggingface_hub read these at import: keep a developer's saved token and an inherited
        # HF_HUB_OFFLINE out of the tests.
        monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
        monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
        # huggingface_hub 2.x fetches an "agent harness" registry from the import-time endpoint
        # (huggingface.co) on first use unless a fresh copy is cached: give it one, so nothing in
        # these tests leaves 127.0.0.1.
        agents = tmp_path / "hf" / "agent_harnesses.json"
        agents.parent.mkdir(parents=True, exist_ok=True)
        agents.write_text(json.dumps({"standardEnvVars": [], "harnesses": {}}))
        monkeypatch.setattr(hf_constants, "AGENT_HARNESSES_PATH", str(agents), raising=False)
        yield server


def cache_root(tmp_path: Path) -> Path:
    return tmp_path / "hf" / "hub"


def expected_files(ckpt_dir: Path, include_original: bool = False) -> list[str]:
    paths = sorted(p.relative_to(ckpt_dir).as_posix() for p in ckpt_dir.rglob("*") if p.is_file())
    return sorted(select_files(paths, include_original))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_cli_error(stderr: str, pattern: str = "") -> None:
    """The CLI showed exactly one 'error: ...' line, last on stderr (tqdm bars may come before it)."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    assert "Traceback" not in stderr
    assert re.search(pattern, errors[0]), errors[0]


def assert_one_line(msg: str, *secrets: str) -> None:
    assert "\n" not in msg.strip(), msg
    for s in secrets:
        assert s not in msg, f"token leaked into: {msg}"


# --- pure helpers -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("openai/gpt-oss-20b", ("openai/gpt-oss-20b", None)),
        ("openai/gpt-oss-120b@main", ("openai/gpt-oss-120b", "main")),
        ("org/name.v2@" + "a" * 40, ("org/name.v2", "a" * 40)),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
    ],
)
def test_parse_repo_spec(spec, expected):
    assert parse_repo_spec(spec) == expected


@pytest.mark.parametrize("spec", ["gpt-oss-20b", "a/b/c", "org/name@", "org/na me", "org/-x", "org/a--b", "/abs/path"])
def test_parse_repo_spec_rejects(spec):
    with pytest.raises(GptOssFp8Error, match="not a Hugging Face repo id"):
        parse_repo_spec(spec)


def test_select_files_skips_original_and_metal():
    paths = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "README.md",
             ".gitattributes", "original/model.safetensors", "original/config.json", "metal/model.bin",
             "tokenizer.json", "chat_template.jinja", "generation_config.json"]
    assert select_files(paths) == ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
                                   "tokenizer.json", "chat_template.jinja", "generation_config.json"]
    with_orig = select_files(paths, include_original=True)
    assert {"original/model.safetensors", "original/config.json", "metal/model.bin"} <= set(with_orig)
    assert "README.md" not in with_orig and "*.safetensors" in CONVERTER_PATTERNS


def test_hub_server_protocol(hub, ckpt_dir):
    """The server side on its own: what huggingface_hub reads, plus raw range requests."""
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=False)
    info = api.model_info(REPO, files_metadata=True)
    shard = next(s for s in info.siblings if s.rfilename == "model-00001-of-00004.safetensors")
    assert info.sha == hub.repos[REPO].refs["main"] and shard.lfs is not None
    assert shard.lfs.sha256 == sha256(ckpt_dir / shard.rfilename) and shard.size == (ckpt_dir / shard.rfilename).stat().st_size
    paths = api.get_paths_info(REPO, ["config.json", "original", "missing.txt"], revision="main")
    assert sorted(p.path for p in paths) == ["config.json", "original"]
    top = {f.path for f in api.list_repo_tree(REPO)}  # not recursive: folders, no files inside them
    assert {"original", "metal", "config.json"} <= top and not any("/" in p for p in top)

    url = f"{hub.endpoint}/{REPO}/resolve/main/config.json"
    data = (ckpt_dir / "config.json").read_bytes()
    head = urllib.request.urlopen(urllib.request.Request(url, method="HEAD"))
    assert head.headers["X-Repo-Commit"] == info.sha and int(head.headers["Content-Length"]) == len(data)
    assert head.headers["ETag"].strip('"') == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    part = urllib.request.urlopen(urllib.request.Request(url, headers={"Range": "bytes=10-"}))
    assert part.status == 206 and part.read() == data[10:]
    assert part.headers["Content-Range"] == f"bytes 10-{len(data) - 1}/{len(data)}"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(urllib.request.Request(url, headers={"Range": f"bytes={len(data)}-"}))
    assert e.value.code == 416


# --- download ---------------------------------------------------------------------------------------


def test_dry_run_lists_files_and_bytes_and_writes_nothing(hub, tmp_path, ckpt_dir):
    result = download(REPO, dry_run=True)
    names = sorted(f.path for f in result.files)
    assert names == expected_files(ckpt_dir)
    assert all((ckpt_dir / f.path).stat().st_size == f.size for f in result.files)
    assert result.total_bytes == sum((ckpt_dir / n).stat().st_size for n in names)
    assert result.bytes_to_fetch == result.total_bytes and not any(f.cached for f in result.files)
    assert result.revision == hub.repos[REPO].refs["main"]
    assert result.path == cache_root(tmp_path) / "models--test-org--gpt-oss-tiny" / "snapshots" / result.revision
    assert not result.path.exists()
    assert not [r for r in hub.requests if r.method == "GET" and r.filename], "a dry run must not fetch files"

    out = CliRunner().invoke(app, ["download", REPO, "--dry-run"])
    assert out.exit_code == 0, out.output
    for n in names:
        assert n in out.stdout
    assert f"{result.total_bytes:,d} bytes" in out.stdout
    assert "original/" not in out.stdout and "metal/" not in out.stdout


def test_full_download_then_cached(hub, tmp_path, ckpt_dir):
    result = download(REPO)
    sha = hub.repos[REPO].refs["main"]
    assert result.revision == sha and not result.dry_run and not result.offline
    assert result.path == cache_root(tmp_path) / "models--test-org--gpt-oss-tiny" / "snapshots" / sha
    got = sorted(p.relative_to(result.path).as_posix() for p in result.path.rglob("*") if p.is_file())
    assert got == expected_files(ckpt_dir)
    for name in got:
        assert (result.path / name).read_bytes() == (ckpt_dir / name).read_bytes(), name
    assert not (result.path / "original").exists() and not (result.path / "metal").exists()
    assert not [r for r in hub.requests if r.filename and r.filename.startswith(("original/", "metal/"))]

    # A second call transfers nothing and reports everything cached.
    n_get = len([r for r in hub.requests if r.method == "GET" and r.filename])
    again = download(REPO)
    assert again.path == result.path and all(f.cached for f in again.files)
    assert len([r for r in hub.requests if r.method == "GET" and r.filename]) == n_get


def test_include_original(hub, ckpt_dir):
    out = CliRunner().invoke(app, ["download", REPO, "--include-original"])
    assert out.exit_code == 0, out.output
    result = download(REPO, include_original=True)
    assert out.stdout.splitlines()[-2:] == [f"commit {result.revision}", str(result.path)]
    assert (result.path / "original" / "model.safetensors").read_bytes() == (
        ckpt_dir / "original" / "model.safetensors"
    ).read_bytes()
    assert (result.path / "metal" / "model.bin").is_file()
    assert sorted(f.path for f in result.files) == expected_files(ckpt_dir, include_original=True)


def test_revision_and_local_dir(hub, tmp_path, ckpt_dir):
    sha = hub.repos[REPO].refs["main"]
    dest = tmp_path / "local"
    result = download(REPO, revision=sha, local_dir=dest)
    assert result.path == dest.resolve() and result.revision == sha
    assert (dest / "config.json").read_bytes() == (ckpt_dir / "config.json").read_bytes()
    assert not (dest / "original").exists()
    assert not cache_root(tmp_path).joinpath("models--test-org--gpt-oss-tiny", "snapshots").exists()
    assert all(f.cached for f in download(REPO, revision=sha, local_dir=dest, dry_run=True).files)


def test_branch_with_slash_pins_its_commit_and_works_offline(hub, tmp_path, ckpt_dir, monkeypatch):
    pr = tmp_path / "pr"
    shutil.copytree(ckpt_dir, pr)
    (pr / "generation_config.json").write_text('{"do_sample": false}\n')
    pr_sha = hub.add_repo(REPO, pr, refs=("refs/pr/1",))
    assert pr_sha != hub.repos[REPO].refs["main"]
    result = download(REPO, revision="refs/pr/1")
    assert result.revision == pr_sha and result.path.name == pr_sha
    assert (result.path / "generation_config.json").read_text() == '{"do_sample": false}\n'
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert download(REPO, revision="refs/pr/1").path == result.path
    with pytest.raises(GptOssFp8Error, match="not in the Hugging Face cache"):
        download(REPO)  # main was never fetched


def test_resume_after_connection_drop(hub):
    shard = "model-00001-of-00001.safetensors"
    cut = 15 * 1024 * 1024
    hub.drop_after(BIG, shard, cut)
    result = download(BIG)
    gets = hub.requests_for(shard)
    assert len(gets) == 2, [(r.status, r.range, r.body_bytes) for r in gets]
    assert gets[0].range is None and gets[0].body_bytes == cut
    # Resumed with a range request from where the written data ended, not from zero.
    assert gets[1].range is not None and gets[1].status == 206
    resumed_at = int(gets[1].range.removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= cut
    assert gets[1].body_bytes == BIG_SIZE - resumed_at
    assert sha256(result.path / shard) == hub.file(BIG, shard).sha256


# Under -m slow (~11 s: a real process). huggingface_hub's thread pool waits for the files in flight
# when it shuts down, so a Ctrl-C used to be answered once the transfer was done (20 s on this slow
# link in a hand-run; minutes for 4 GB shards): now at once, its partial file removed.
@pytest.mark.slow
def test_ctrl_c_during_a_transfer_ends_it_at_once_and_leaves_no_partial_file(hub, tmp_path):
    shard = "model-00001-of-00001.safetensors"
    hub.chunk_delay = 1.0  # 24 MiB at 1 MiB a second
    p = subprocess.Popen([sys.executable, "-m", "gptoss_fp8.cli.main", "download", BIG],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not [f for f in cache_root(tmp_path).rglob("*.incomplete") if f.stat().st_size > 0]:
        assert p.poll() is None and time.monotonic() - t0 < 120, p.communicate()
        time.sleep(0.05)
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    took = time.monotonic() - t
    assert p.returncode == 130 and err.rstrip().splitlines()[-1].endswith("interrupted"), err
    assert took < 10, f"exit {took:.1f} s after Ctrl-C, with ~20 s of the transfer to go"
    assert not list(cache_root(tmp_path).rglob("*.incomplete"))
    hub.chunk_delay = 0
    result = download(BIG)
    assert sha256(result.path / shard) == hub.file(BIG, shard).sha256


def test_offline_warm_cache_uses_it_without_network(hub, monkeypatch):
    online = download(REPO)
    n = len(hub.requests)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = download(REPO)
    assert len(hub.requests) == n, "offline mode contacted the hub"
    assert offline.offline and offline.path == online.path and offline.revision == online.revision
    assert sorted(f.path for f in offline.files) == sorted(f.path for f in online.files)
    assert resolve_source(REPO) == ResolvedSource(online.path, REPO, online.revision)


def test_offline_cold_cache_says_what_to_do(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(GptOssFp8Error) as e:
        download(REPO)
    msg = str(e.value)
    assert_one_line(msg)
    assert REPO in msg and "HF_HUB_OFFLINE" in msg and f"gptoss-fp8 download {REPO}" in msg
    assert not hub.requests

    out = CliRunner().invoke(app, ["download", REPO])
    assert out.exit_code == 1
    assert_cli_error(out.stderr, "HF_HUB_OFFLINE")


def test_unreachable_hub_falls_back_to_cache(hub, monkeypatch):
    online = download(REPO)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", dead)
    again = download(REPO)
    assert again.offline and again.path == online.path
    with pytest.raises(GptOssFp8Error, match="cannot reach the hub") as e:
        download(GATED)
    assert_one_line(str(e.value))


@pytest.mark.parametrize(
    "repo, revision, token, pattern",
    [
        ("test-org/no-such-repo", None, None, r"repo test-org/no-such-repo not found .*401"),
        ("test-org/no-such-repo", None, GOOD_TOKEN, r"repo test-org/no-such-repo not found .*404"),
        (REPO, "no-such-branch", None, r"revision 'no-such-branch' not found in test-org/gpt-oss-tiny"),
        (GATED, None, None, r"gated and no token was sent"),
        (GATED, None, OTHER_TOKEN, r"gated and the token's account has not been granted access \(403\)"),
        (REPO, None, BAD_TOKEN, r"rejected the token .*401, invalid token"),
    ],
)
def test_http_errors_are_one_line_without_token(hub, tmp_path, repo, revision, token, pattern):
    with pytest.raises(GptOssFp8Error, match=pattern) as e:
        download(repo, revision=revision, token=token)
    assert_one_line(str(e.value), GOOD_TOKEN, OTHER_TOKEN, BAD_TOKEN)
    if token is not None:  # the token did reach the hub
        assert any(r.authorization == f"Bearer {token}" for r in hub.requests)

    # Same through the CLI, with the token from --token and from HF_TOKEN.
    args = ["download", repo if revision is None else f"{repo}@{revision}"]
    for extra, env in ((["--token", token], {}), ([], {"HF_TOKEN": token})) if token else (([], {}),):
        out = CliRunner().invoke(app, args + extra, env=env)
        assert out.exit_code == 1, out.output
        assert_cli_error(out.stderr, pattern)
        assert not any(t in out.output for t in (GOOD_TOKEN, OTHER_TOKEN, BAD_TOKEN))


def test_dry_run_of_gated_repo_checks_access(hub):
    with pytest.raises(GptOssFp8Error, match="gated and no token was sent"):
        download(GATED, dry_run=True)
    assert download(GATED, dry_run=True, token=GOOD_TOKEN).total_bytes > 0
    assert not [r for r in hub.requests if r.method == "GET" and r.filename]


def test_gated_repo_with_granted_token(hub, monkeypatch, ckpt_dir):
    monkeypatch.setenv("HF_TOKEN", GOOD_TOKEN)
    result = download(GATED)
    assert (result.path / "config.json").read_bytes() == (ckpt_dir / "config.json").read_bytes()
    assert all(r.authorization == f"Bearer {GOOD_TOKEN}" for r in hub.requests)


@pytest.mark.parametrize(
    "path, mode, pattern",
    [
        ("model-00001-of-00004.safetensors", "truncate", r"arrived with \d+ bytes but the hub announced \d+"),
        ("model-00001-of-00004.safetensors", "flip", r"does not match its announced sha256"),
        ("config.json", "flip", r"does not match its announced git blob id"),
        ("config.json", "truncate", r"arrived with \d+ bytes but the hub announced \d+"),
    ],
)
def test_corrupt_transfer_is_rejected_and_not_kept(hub, tmp_path, ckpt_dir, path, mode, pattern):
    hub.tamper(REPO, path, mode)
    with pytest.raises(GptOssFp8Error, match=pattern) as e:
        download(REPO)
    assert_one_line(str(e.value))
    assert path in str(e.value)
    snapshot = cache_root(tmp_path) / "models--test-org--gpt-oss-tiny" / "snapshots" / hub.repos[REPO].refs["main"]
    assert not (snapshot / path).exists(), "the bad copy stayed in the cache"
    blobs = cache_root(tmp_path) / "models--test-org--gpt-oss-tiny" / "blobs"
    good = {hub.file(REPO, p).etag for p in expected_files(ckpt_dir)}
    assert {b.name for b in blobs.iterdir() if not b.name.endswith(".incomplete")} <= good

    # Once the hub serves the right bytes, the next run completes.
    hub.clear_faults()
    result = download(REPO)
    assert (result.path / path).read_bytes() == (ckpt_dir / path).read_bytes()


def test_corrupt_transfer_into_local_dir(hub, tmp_path, ckpt_dir):
    path = "model-00002-of-00004.safetensors"
    hub.tamper(REPO, path, "flip")
    dest = tmp_path / "local"
    with pytest.raises(GptOssFp8Error, match="sha256"):
        download(REPO, local_dir=dest)
    assert not (dest / path).exists()
    hub.clear_faults()
    assert sha256(download(REPO, local_dir=dest).path / path) == sha256(ckpt_dir / path)


# --- resolve_source, and convert from a repo id -------------------------------------------------------


def test_resolve_source_local_and_errors(hub, tmp_path, ckpt_dir):
    assert resolve_source(ckpt_dir) == ResolvedSource(ckpt_dir)
    assert resolve_source(str(ckpt_dir)) == ResolvedSource(ckpt_dir)
    assert not hub.requests
    for spec in ("./nope", str(tmp_path / "missing"), "a/b/c", "justaname"):
        with pytest.raises(GptOssFp8Error, match="no such directory, and not a Hugging Face repo id"):
            resolve_source(spec)
    with pytest.raises(GptOssFp8Error, match="is a file"):
        resolve_source(ckpt_dir / "config.json")
    with pytest.raises(GptOssFp8Error, match="names revision"):
        resolve_source(f"{REPO}@main", revision="other")
    assert not hub.requests
    with pytest.raises(GptOssFp8Error, match="out/model is not a local directory; as a hub repo id: repo out/model not found"):
        resolve_source("out/model")
    with pytest.raises(GptOssFp8Error, match="as a hub repo id: revision 'refs/pr/1' not found"):
        resolve_source(f"{REPO}@refs/pr/1")


def test_resolve_source_downloads_converter_files_only(hub, ckpt_dir):
    src = resolve_source(f"{REPO}@main")
    assert src.repo_id == REPO and src.revision == hub.repos[REPO].refs["main"]
    assert src.provenance() == {"repo_id": REPO, "revision": src.revision}
    assert not (src.path / "original").exists()
    assert json.loads((src.path / "config.json").read_text()) == json.loads((ckpt_dir / "config.json").read_text())


def test_convert_from_repo_id_matches_local_path(hub, tmp_path, ckpt_dir):
    from gptoss_fp8.convert.convert import convert_checkpoint

    local_out, hub_out = tmp_path / "from-path", tmp_path / "from-hub"
    convert_checkpoint(ckpt_dir, local_out)
    out = CliRunner().invoke(app, ["convert", REPO, str(hub_out)])
    assert out.exit_code == 0, out.output

    compared = sorted(p.name for p in local_out.glob("*.safetensors")) + ["model.safetensors.index.json"]
    assert len(compared) > 1
    assert compared == sorted(p.name for p in hub_out.glob("*.safetensors")) + ["model.safetensors.index.json"]
    for name in compared:
        assert (hub_out / name).read_bytes() == (local_out / name).read_bytes(), name
    report = json.loads((hub_out / "conversion.json").read_text())
    assert report["source"]["repo_id"] == REPO
    assert report["source"]["revision"] == hub.repos[REPO].refs["main"]
