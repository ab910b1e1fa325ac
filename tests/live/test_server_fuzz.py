"""A bounded schemathesis fuzz of every operation of the live server's OpenAPI document.

The server runs for real on loopback with the tiny models and real SQLite; schemathesis generates
requests from /openapi.json, schema-valid ones (positive) and schema-violating ones (negative), for
every operation, and each response is checked: never a 5xx, a status the document lists for the
operation, its content type, its body against the documented schema. Failures are collected rather
than raised at the first one, so the summary (requests, 5xx, schema failures) counts them all;
pytest prints it at the end of the run. About a minute on 2 cores.

Half the chat operation's positive cases are steered towards generation: the routed model name,
and none of the fields whose random values are refused (a random `model` is a 404, random `stop`
sequences a 400): the cases that reach the engine and the store are the ones worth fuzzing.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from tiny_serving import FUZZ_SUMMARY, KEYS

from flywheel.live.server import LiveServer, ServeConfig, serve_in_thread
from flywheel.live.settings import LoopConfig
from flywheel.live.store import LiveStore

# Per operation and mode; the chat operation gets more positives, the ones that reach the engine.
# FLYWHEEL_FUZZ_SCALE=10 makes a longer hunt (about 10x the minute).
SCALE = float(os.environ.get("FLYWHEEL_FUZZ_SCALE", "1"))
EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 25}
CHAT_POSITIVE = 100
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
AUTH = {"authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def live(registry_root, tmp_path_factory):
    # Small generation limits keep each served request to milliseconds; the limits themselves get fuzzed.
    config = ServeConfig(loop=LoopConfig.at(tmp_path_factory.mktemp("live") / "live.sqlite", registry_root), keys=KEYS,
                         candidate_fraction=0.5, max_body_bytes=256 * 1024, max_events_per_batch=50,
                         default_max_tokens=4, max_tokens_limit=8, max_context_tokens=4096, threads=1)
    server = LiveServer.from_config(config)
    with serve_in_thread(server) as running:
        yield server, running.url
    server.close()


@pytest.mark.slow  # 28 s on the shared 2-core machine (load ~10)
def test_fuzz_every_operation_no_5xx_and_conforming_responses(live, request):
    server, url = live
    document = httpx.get(f"{url}/openapi.json").json()
    assert document["openapi"].startswith("3.")
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {
        "POST /v1/chat/completions", "POST /v1/events", "GET /v1/models", "GET /health", "GET /dashboard",
        "GET /dashboard/data", "GET /v1/admin/deployment", "POST /v1/admin/deployment",
        "POST /v1/admin/deployment/sync"}
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    started = time.perf_counter()
    served = 0
    for operation in operations:
        for mode, examples in EXAMPLES.items():
            if operation.path == "/v1/chat/completions" and mode == GenerationMode.POSITIVE:
                examples = CHAT_POSITIVE
            before = statuses[200]
            run_operation(operation, mode, max(1, round(examples * SCALE)), url, statuses, failures)
            served += (statuses[200] - before) if operation.path == "/v1/chat/completions" else 0
    seconds = time.perf_counter() - started
    requests = sum(statuses.values())
    server_errors = sum(n for status, n in statuses.items() if status >= 500)
    by_class = ", ".join(f"{s // 100}xx {sum(n for t, n in statuses.items() if t // 100 == s // 100)}"
                         for s in sorted({t // 100 * 100 for t in statuses}))
    request.config.stash.setdefault(FUZZ_SUMMARY, []).append(
        f"fuzz: {requests} requests over {len(operations)} operations in {seconds:.0f} s: {server_errors} 5xx, "
        f"{len(failures)} schema failures ({by_class}; {served} chat completions generated and stored)")
    assert requests >= len(operations) * 20 and served > 0
    kinds = Counter(line.strip() for f in failures for line in f.splitlines() if line.strip().startswith("- "))
    assert server_errors == 0 and not failures, f"{dict(kinds)}\n\n" + "\n\n".join(failures[:5])
    # What the fuzz stored still reads back, through a second connection as the distiller would.
    with LiveStore(server.config.loop.store.path) as reader:
        assert reader.count_completions() == len(reader.completions()) > 0
        reader.events(start=0.0)
    assert httpx.get(f"{url}/dashboard/data", headers=AUTH, timeout=60).status_code == 200


def test_the_checks_catch_a_response_that_breaks_the_document(live):
    """The fuzz can fail: with /health documented as returning a model list, every answer is a failure."""
    _, url = live
    document = httpx.get(f"{url}/openapi.json").json()
    document["paths"]["/health"]["get"]["responses"]["200"] = document["paths"]["/v1/models"]["get"]["responses"]["200"]
    [health] = [r.ok() for r in schemathesis.openapi.from_dict(document).get_all_operations()
                if r.ok().path == "/health"]
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    run_operation(health, GenerationMode.POSITIVE, 3, url, statuses, failures)
    assert statuses[200] >= 1 and len(failures) == statuses[200] and "schema" in failures[0].lower()


def run_operation(operation, mode: GenerationMode, examples: int, url: str, statuses: Counter[int],
                  failures: list[str]) -> None:
    routed = operation.path == "/v1/chat/completions" and mode == GenerationMode.POSITIVE
    seen = [0]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    def fuzz(case) -> None:
        seen[0] += 1
        if routed and seen[0] % 2 and isinstance(case.body, dict):
            # Towards the generation path: each of these fields alone refuses most random values.
            case.body["model"] = "flywheel"
            for refused_mostly in ("stop", "response_format", "tools", "max_tokens", "max_completion_tokens",
                                   "metadata"):
                case.body.pop(refused_mostly, None)
        response = case.call(base_url=url, headers=AUTH, timeout=60)
        statuses[response.status_code] += 1
        try:
            case.validate_response(response, checks=CHECKS, headers=AUTH)
        except (AssertionError, FailureGroup) as exc:  # counted, not raised: the summary holds them all
            failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}) -> "
                            f"{response.status_code}: {exc}\n{case.as_curl_command(headers=AUTH)}")

    try:
        fuzz()
    except Unsatisfiable:
        if mode != GenerationMode.NEGATIVE:
            raise  # an operation without parameters or a body has nothing to violate; every one has positives
