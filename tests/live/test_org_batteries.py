"""Organizations' eval batteries from files: `flywheel tasks export --org` writes a simulated
organization's tasks (its house rules applied), `[orgs.batteries]` in the live config names them,
and the cycle reads them into its per-organization gate, refusing a bad id, a missing file or a
malformed line before any cycle starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from flywheel.cli import main
from flywheel.config import ConfigError, load_config
from flywheel.env.families import generate
from flywheel.env.task import read_tasks, write_tasks
from flywheel.live.cycle import LiveConfig, LiveCycle, org_batteries
from flywheel.live.store import LiveStore
from flywheel.model.registry import Registry
from flywheel.sim.orgs import HouseRules

REPO = Path(__file__).resolve().parents[2]
POPULATION = REPO / "configs" / "population.toml"  # its acme-dev profile: house_rules for "acme"


def _export(out: Path, *extra: str) -> int:
    return main(["tasks", "export", "--org", "acme", "--split", "eval", "--n", "3", "--population", str(POPULATION),
                 "--out", str(out), *extra])


def _live_config(tmp_path: Path, batteries: dict[str, Path]) -> Path:
    lines = ["[orgs]", "enabled = true", "", "[orgs.batteries]"]
    lines += [f'{org} = "{path}"' for org, path in batteries.items()]
    config = tmp_path / "live.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def test_export_writes_the_organizations_tasks_and_they_read_back_equal(tmp_path):
    out = tmp_path / "batteries" / "acme.jsonl"
    assert _export(out) == 0
    tasks = read_tasks(out)
    acme = HouseRules(org_id="acme", helper="audit", call="record", tests_dir="checks")  # the profile's rules
    assert tasks == [acme.adapt(t) for t in generate("bugfix", "eval", 3, seed=0)]
    for task in tasks:
        assert task.id.startswith("acme/bugfix/eval/") and task.metadata.extra["org_id"] == "acme"
        assert "record" in task.hidden_tests["tests_hidden/test_house_rules.py"]  # graded by the house rule
        assert task.test_command.split()[-1] == "checks"  # their test layout
    assert write_tasks(tmp_path / "again.jsonl", tasks) == 3
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()


def test_export_refuses_an_unknown_organization_and_a_family_it_cannot_adapt(tmp_path, capsys):
    assert main(["tasks", "export", "--org", "globex", "--population", str(POPULATION),
                 "--out", str(tmp_path / "g.jsonl")]) == 2
    assert "organization 'globex'" in capsys.readouterr().err and not (tmp_path / "g.jsonl").exists()
    assert _export(tmp_path / "i.jsonl", "--family", "implement") == 2
    assert "only bugfix tasks" in capsys.readouterr().err and not (tmp_path / "i.jsonl").exists()


def test_the_cycle_gates_each_organization_on_its_configured_battery(tmp_path):
    battery = tmp_path / "acme.jsonl"
    assert _export(battery) == 0
    config = load_config(LiveConfig, _live_config(tmp_path, {"acme": battery}),
                         [f'loop.store.registry_root="{tmp_path / "registry"}"',
                          f'loop.store.path="{tmp_path / "live.sqlite"}"'])
    assert config.orgs.batteries == {"acme": battery}
    LiveStore(tmp_path / "live.sqlite").close()
    Registry(tmp_path / "registry").close()
    cycle = LiveCycle(config, control=None, log=lambda m: None)  # type: ignore[arg-type]  (no stage runs)
    assert cycle.org_gate_tasks == {"acme": read_tasks(battery)}
    # A Python caller's batteries join the configured ones, and win for the same organization.
    other = generate("bugfix", "eval", 1, seed=9)
    assert org_batteries(config.orgs, {"acme": other, "beta": other}) == {"acme": other, "beta": other}
    assert LiveCycle(config, None, log=lambda m: None,  # type: ignore[arg-type]
                     org_gate_tasks={"beta": other}).org_gate_tasks == {"acme": read_tasks(battery), "beta": other}


def test_a_bad_battery_stops_flywheel_live_before_the_cycle_starts(tmp_path, capsys):
    battery = tmp_path / "acme.jsonl"
    assert _export(battery) == 0
    with pytest.raises(ConfigError, match="organization id 'Acme Corp'"):
        load_config(LiveConfig, _live_config(tmp_path, {'"Acme Corp"': battery}))

    run = ["live", "--config", str(_live_config(tmp_path, {"acme": battery})), "--set", f'run_dir="{tmp_path / "run"}"',
           "--set", 'admin_key="k"']
    lines = battery.read_text().splitlines()
    for text, error in [
        (None, f"no tasks file at {tmp_path / 'missing.jsonl'}"),
        (lines[0] + "\n" + '{"id": "half a task"}\n', f"{battery}:2 is not a Task record (family: Field required)"),
        (lines[0] + "\n\n" + lines[1][:50] + "\n", f"{battery}:3 is not a Task record"),
        ("\n", f"{battery} holds no tasks"),
    ]:
        if text is None:
            run[2] = str(_live_config(tmp_path, {"acme": tmp_path / "missing.jsonl"}))
        else:
            run[2] = str(_live_config(tmp_path, {"acme": battery}))
            battery.write_text(text)
        assert main(run) == 2
        err = capsys.readouterr().err
        assert error in err, err
        assert not list((tmp_path / "run").glob("cycle-*"))  # no cycle began
