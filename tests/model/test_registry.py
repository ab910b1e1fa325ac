"""The checkpoint Registry on real files, a real index (SQLite, and PostgreSQL where `index_url` runs
a test once per backend) and a real tiny MoE model.

The atomicity tests kill a registering process with SIGKILL at the two moments a crash can hit
(files half written; folder published but not yet indexed) and check the registry reopens exactly
as it was.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flywheel.model.factory import ModelConfig, build_model
from flywheel.model.registry import CANDIDATE, PRODUCTION, Registry
from flywheel.model.tokenizer import train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n", "print('hello world')\n", "for i in range(10):\n    x += i\n"] * 4
TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4,
            experts_per_token=2, moe_intermediate_size=32)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_model(ModelConfig(**TINY), tokenizer)


@pytest.fixture(params=["sqlite", "postgresql"])
def index_url(request) -> str | None:
    """None: the default root/registry.sqlite; else a fresh PostgreSQL schema."""
    return None if request.param == "sqlite" else request.getfixturevalue("pg_url")


def other_model(tokenizer, seed: int):
    return build_model(ModelConfig(**TINY, seed=seed), tokenizer)


def logits(model, tokenizer) -> torch.Tensor:
    ids = tokenizer("def add(a, b): return a + b", return_tensors="pt").input_ids
    with torch.no_grad():
        return model(ids).logits  # [1, seq, vocab]


def test_checkpoint_loads_with_plain_transformers(tmp_path, model, tokenizer):
    registry = Registry(tmp_path)
    ckpt = registry.register(model, tokenizer, metrics={"reward": 0.5}, note="init")
    assert ckpt.version == 0 and ckpt.parent is None and ckpt.path == tmp_path / "checkpoints" / "v0"
    assert {"config.json", "model.safetensors", "tokenizer.json", "flywheel.json"} <= {p.name
                                                                                       for p in ckpt.path.iterdir()}
    assert json.loads((ckpt.path / "flywheel.json").read_text())["metrics"] == {"reward": 0.5}

    loaded = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch.float32).eval()
    assert torch.equal(logits(loaded, tokenizer), logits(model, tokenizer))
    hf_tokenizer = AutoTokenizer.from_pretrained(str(ckpt.path))
    assert hf_tokenizer.encode(CORPUS[0]) == tokenizer.encode(CORPUS[0])
    assert hf_tokenizer.chat_template == tokenizer.chat_template

    # the Engine's swap path: strict load of the runtime-layout weights into a fresh model
    fresh = other_model(tokenizer, seed=7)
    fresh.load_state_dict(registry.state_dict(0), strict=True)
    assert torch.equal(logits(fresh, tokenizer), logits(model, tokenizer))
    reloaded, _ = registry.load("v0")
    assert torch.equal(logits(reloaded, tokenizer), logits(model, tokenizer))


def test_versions_parents_aliases_metrics(tmp_path, model, tokenizer, index_url):
    registry = Registry(tmp_path, url=index_url)
    v0 = registry.register(model, tokenizer, aliases=[PRODUCTION])
    v1 = registry.register(other_model(tokenizer, 1), tokenizer, parent=v0.version, aliases=[CANDIDATE])
    assert (v0.version, v1.version, v1.parent) == (0, 1, 0)
    assert registry.get(PRODUCTION).version == 0 and registry.get(CANDIDATE).version == 1
    assert registry.get("v1") == registry.get(1) == registry.get("1")

    registry.set_alias(PRODUCTION, 1)  # promote: moves, does not copy
    assert registry.get(PRODUCTION).version == 1
    assert [c.aliases for c in registry.list()] == [[], [CANDIDATE, PRODUCTION]]
    registry.remove_alias(CANDIDATE)
    assert registry.get(1).aliases == [PRODUCTION]

    registry.update_metrics(1, {"pass_rate": 0.25})
    registry.update_metrics(1, {"edit_rate": 0.1})
    assert registry.get(1).metrics == {"pass_rate": 0.25, "edit_rate": 0.1}

    reopened = Registry(tmp_path, url=index_url)  # everything above is in the index, not in memory
    assert reopened.list() == registry.list()


def test_bad_refs_say_what_exists(tmp_path, model, tokenizer, index_url):
    registry = Registry(tmp_path, url=index_url)
    with pytest.raises(KeyError, match="empty"):
        registry.get(PRODUCTION)
    registry.register(model, tokenizer, aliases=[PRODUCTION])
    # "v٠" (an Arabic-Indic zero) and "0" * 5000 (past int()'s 4,300 digits) are no version: not found.
    for ref in (5, "v5", "staging", "v\u0660", "\u0660", "0" * 5000):
        with pytest.raises(KeyError) as err:
            registry.get(ref)
        assert "versions: v0" in str(err.value) and "production -> v0" in str(err.value)
    with pytest.raises(KeyError, match="v3"):
        registry.set_alias(CANDIDATE, 3)
    with pytest.raises(KeyError, match="staging"):
        registry.remove_alias("staging")
    with pytest.raises(KeyError, match="v9"):
        registry.register(model, tokenizer, parent=9)
    with pytest.raises(ValueError, match="a-z0-9"):
        registry.set_alias("Prod!", 0)
    for alias in ("v2", "1" * 30):
        with pytest.raises(ValueError, match="version number"):
            registry.set_alias(alias, 0)
    assert [c.version for c in registry.list()] == [0]


def test_a_lost_index_is_not_mistaken_for_an_empty_registry(tmp_path, model, tokenizer):
    Registry(tmp_path).register(model, tokenizer)
    (tmp_path / "registry.sqlite").unlink()
    with pytest.raises(ValueError, match="restore the index"):
        Registry(tmp_path)
    assert (tmp_path / "checkpoints" / "v0" / "model.safetensors").is_file()


def test_concurrent_registrations_get_distinct_versions(tmp_path, model, tokenizer, index_url):
    registry = Registry(tmp_path, url=index_url)
    threads = [threading.Thread(target=registry.register, args=(model, tokenizer)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [c.version for c in registry.list()] == [0, 1, 2]


# A registering process that stops at a chosen step, says so, and waits to be killed. What it saves
# are the files of the real checkpoint v0, copied by stand-ins for the model and tokenizer: the
# registry code path is the real one, and the child starts in a fraction of a second because it
# never imports torch.
KILLED_WRITER = textwrap.dedent("""
    import shutil, sys, time
    from pathlib import Path
    from flywheel.model.registry import Registry

    root, stop_at = Path(sys.argv[1]), sys.argv[2]
    source = root / "checkpoints" / "v0"
    MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors"}

    class CopyOf:
        def __init__(self, names):
            self.names = names

        def save_pretrained(self, out, **kwargs):
            for name in self.names:
                shutil.copy(source / name, Path(out) / name)

    def hang(*args, **kwargs):
        print("ready", flush=True)
        time.sleep(120)

    model = CopyOf(MODEL_FILES)
    tokenizer = CopyOf({p.name for p in source.iterdir()} - MODEL_FILES - {"flywheel.json"})
    if stop_at == "files":  # the model is written, the tokenizer not yet
        tokenizer.save_pretrained = hang
    else:  # the folder is renamed into place, the index not yet committed
        Registry._index = hang
    Registry(root).register(model, tokenizer, parent=0, aliases=["production", "candidate"])
""")


def register_and_kill(root: Path, stop_at: str, while_hung=lambda: None) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(root), stop_at],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline()
        assert line.strip() == "ready", f"writer did not reach {stop_at!r}: {proc.stderr.read()}"
        while_hung()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
    finally:
        watchdog.cancel()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("stop_at", ["files", "index"])
def test_a_killed_write_leaves_the_previous_state(tmp_path, model, tokenizer, stop_at):
    registry = Registry(tmp_path)
    registry.register(model, tokenizer, aliases=[PRODUCTION], metrics={"reward": 1.0})
    before = registry.list()
    registry.close()

    def a_reader_meanwhile():  # sees the old state and must not clean up a write still in progress
        with Registry(tmp_path) as reader:
            assert reader.list() == before
        assert len(list((tmp_path / "checkpoints").iterdir())) == 2

    register_and_kill(tmp_path, stop_at, a_reader_meanwhile)
    leftovers = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    if stop_at == "files":
        assert leftovers[0].startswith(".tmp-v1-") and leftovers[1:] == ["v0"]
        assert (tmp_path / "checkpoints" / leftovers[0] / "model.safetensors").is_file()  # killed midway
    else:
        assert leftovers == ["v0", "v1"]  # published, never indexed

    reopened = Registry(tmp_path)
    assert reopened.list() == before
    assert reopened.get(PRODUCTION).version == 0
    with pytest.raises(KeyError):
        reopened.get(CANDIDATE)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["v0"]  # crash residue removed
    loaded, _ = reopened.load(PRODUCTION)
    assert torch.equal(logits(loaded, tokenizer), logits(model, tokenizer))

    again = reopened.register(other_model(tokenizer, 3), tokenizer, parent=0)  # the lost version number is reused
    assert again.version == 1 and [c.version for c in reopened.list()] == [0, 1]


def flywheel(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flywheel.cli", *args], capture_output=True, text=True, timeout=60)


def test_cli_list_show_promote(tmp_path, model, tokenizer):
    registry = Registry(tmp_path)
    registry.register(model, tokenizer, aliases=[PRODUCTION], metrics={"pass_rate": 0.5})
    registry.register(model, tokenizer, parent=0, aliases=[CANDIDATE])
    registry.close()
    root = ["--root", str(tmp_path)]

    listed = flywheel("registry", "list", *root)
    assert listed.returncode == 0, listed.stderr
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert rows[0][0] == "v0" and PRODUCTION in rows[0] and "pass_rate=0.5" in rows[0]
    assert rows[1][:2] == ["v1", "v0"] and CANDIDATE in rows[1]

    shown = flywheel("registry", "show", "candidate", *root)
    assert shown.returncode == 0, shown.stderr
    record = json.loads(shown.stdout[: shown.stdout.rindex("}") + 1])
    assert record["version"] == 1 and record["parent"] == 0 and "model.safetensors" in shown.stdout

    promoted = flywheel("registry", "promote", "v1", *root)
    assert promoted.returncode == 0 and "production: v0 -> v1" in promoted.stdout
    assert Registry(tmp_path).get(PRODUCTION).version == 1

    unknown = flywheel("registry", "promote", "v7", *root)
    assert unknown.returncode == 2 and unknown.stderr.startswith("error: no checkpoint 'v7'")
    assert "v0, v1" in unknown.stderr
    missing = flywheel("registry", "show", *root)
    assert missing.returncode == 2 and "needs a version" in missing.stderr
    nowhere = flywheel("registry", "list", "--root", str(tmp_path / "nope"))
    assert nowhere.returncode == 2 and "no registry" in nowhere.stderr
    assert not (tmp_path / "nope").exists()  # a wrong --root does not create an empty registry
