"""Soak: a mixed load against `fluxlab serve` on loopback, phase by phase (DESIGN §12).

Each phase runs, for a fixed time and at most a fixed number of requests, a mix of plain and
streamed completions and chats, streams the client drops after the first chunk, requests the
client abandons mid-generation, bad inputs (malformed bodies and knob values past their bounds),
greedy and seeded requests whose text must equal the same request run alone before the phases,
and heavy requests (knobs that multiply work) that must end by the server's request deadline. It
checks that every good request completes with exactly the tokens it asked for, every bad one is a
4xx, nothing is a 5xx, the KV pages all come back once the phase is idle (/get_load), and reports
the server's RSS after each phase.

    python -m fluxlab.bench.soak --phases 5 --phase-seconds 120       # starts the default server
    python -m fluxlab.bench.soak --url http://127.0.0.1:8000 --pid 1234

Only loopback URLs are accepted: this is a load generator.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import httpx

KINDS = ("completion", "chat", "stream", "chat_stream", "disconnect", "abandon", "bad", "greedy", "seeded",
         "tiny_temperature", "heavy")
WEIGHTS = (3, 2, 3, 2, 1, 1, 3, 2, 2, 1, 2)
# Requests whose text must not depend on their neighbours: each is run alone first (the reference).
EXACT_PROMPTS = [f"exact prompt {i}:" for i in range(4)]
EXACT_TOKENS = 24
EXACT_KNOBS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "top_p": 0.95},
               "tiny_temperature": {"temperature": 1e-300}}  # once a 500 (NaN probabilities); now the argmax
# Bad inputs and the statuses they must get (anything else, and any 5xx, is a failure).
BAD = [
    ("/v1/completions", {"prompt": "", "max_tokens": 4}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("/v1/completions", {"prompt": "x", "seed": 2**80}, 400),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 3}}, 400),
    ("/v1/completions", {"prompt": [10**9]}, 400),
    ("/v1/completions", {"prompt": "x", "model": "no-such-model"}, 404),
    ("/v1/completions", {"prompt": "ab " * 200_000}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, 400),
    # Schema-valid types, values past the knobs' bounds (issue 35): a 400 naming the field, never a 500.
    ("/v1/completions", {"prompt": "x", "top_k": 2**70}, 400),
    ("/v1/completions", {"prompt": "x", "decoder": "joint_threshold", "max_post_steps": 2**70}, 400),
    # Past the server's ceiling (decoding.max_post_steps_limit): once 8 of these held every seat for minutes.
    ("/v1/completions", {"prompt": "x", "decoder": "joint_threshold", "editing_threshold": 0, "temperature": 3,
                         "max_post_steps": 10**9}, 400),
    ("/v1/completions", {"prompt": "x", "decoder": "levenshtein_joint", "max_steps_per_block": 2**70}, 400),
    ("/v1/completions", {"prompt": [-1, 5]}, 400),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": "yes"}, 400),
]
RAW_BAD = [b"{not json", b"[1, 2]", b'{"prompt": "\\ud800", "max_tokens": 2}']


@dataclass
class PhaseReport:
    phase: int
    seconds: float
    requests: int
    by_kind: dict
    statuses: dict
    failures: list
    kv_free_pages: int
    kv_total_pages: int
    rss_mib: Optional[float]


@dataclass
class SoakReport:
    phases: list = field(default_factory=list)

    @property
    def failures(self) -> list:
        return [f for p in self.phases for f in p.failures]

    @property
    def server_errors(self) -> int:
        return sum(n for p in self.phases for s, n in p.statuses.items() if str(s).startswith("5"))

    def table(self) -> str:
        rows = ["phase  seconds  requests  req/s  5xx  failures  free/total pages  rss MiB"]
        for p in self.phases:
            fives = sum(n for s, n in p.statuses.items() if str(s).startswith("5"))
            rss = f"{p.rss_mib:.0f}" if p.rss_mib is not None else "-"
            rate = p.requests / p.seconds if p.seconds > 0 else 0.0
            rows.append(f"{p.phase:>5}  {p.seconds:>7.1f}  {p.requests:>8}  {rate:>5.1f}  {fives:>3}  {len(p.failures):>8}  "
                        f"{p.kv_free_pages:>7}/{p.kv_total_pages:<8}  {rss:>7}")
        return "\n".join(rows)


def rss_mib(pid: Optional[int]) -> Optional[float]:
    """Resident memory of a process and its children (TP ranks, replicas), from /proc."""
    if pid is None:
        return None
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (children, theirs, ...), from /proc."""
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            out += children
            todo += children
    return out


@dataclass
class Heavy:
    """Requests whose knobs multiply work (within the server's ceilings) and the deadline they must keep."""
    knobs: dict
    deadline_s: float  # the server's server.request_timeout_s
    slack_s: float = 30.0  # a loaded machine's delay between the deadline and the response


DEFAULT_HEAVY = Heavy({"decoder": "joint_threshold", "editing_threshold": 0.0, "temperature": 3.0}, deadline_s=600.0)


def exact_body(model: str, kind: str, i: int) -> dict:
    """The i-th greedy or seeded request (the seeded one's seed is fixed by i)."""
    body = {"model": model, "prompt": EXACT_PROMPTS[i], "max_tokens": EXACT_TOKENS, "ignore_eos": True,
            **EXACT_KNOBS[kind]}
    return {**body, "seed": 1000 + i} if kind == "seeded" else body


async def solo_texts(http: httpx.AsyncClient, model: str) -> dict:
    """Each exact request run alone, one after another on an idle server: the texts the soak compares to."""
    texts = {}
    for kind in EXACT_KNOBS:
        for i in range(len(EXACT_PROMPTS)):
            response = await http.post("/v1/completions", json=exact_body(model, kind, i))
            response.raise_for_status()
            texts[kind, i] = response.json()["choices"][0]["text"]
    return texts


class _Load:
    def __init__(self, http: httpx.AsyncClient, model: str, rng: random.Random, max_tokens: int,
                 references: dict, heavy: Heavy):
        self.http, self.model, self.rng, self.max_tokens = http, model, rng, max_tokens
        self.references, self.heavy = references, heavy
        self.statuses: Counter = Counter()
        self.kinds: Counter = Counter()
        self.failures: list[str] = []

    def fail(self, kind: str, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(f"{kind}: {message}")

    def body(self, chat: bool, n: int) -> dict:
        common = {"model": self.model, "max_tokens": n, "ignore_eos": True}
        if chat:
            return {**common, "messages": [{"role": "user", "content": f"question {self.rng.randrange(10**6)}"}]}
        return {**common, "prompt": f"soak prompt {self.rng.randrange(10**6)}:"}

    async def one(self, kind: str) -> None:
        self.kinds[kind] += 1
        n = self.rng.randint(1, self.max_tokens)
        try:
            if kind in ("completion", "chat"):
                await self.plain(kind, n)
            elif kind in ("stream", "chat_stream"):
                await self.stream(kind, n)
            elif kind == "disconnect":
                await self.disconnect(n)
            elif kind == "abandon":
                await self.abandon()
            elif kind in EXACT_KNOBS:
                await self.exact(kind)
            elif kind == "heavy":
                await self.heavy_request()
            else:
                await self.bad()
        except httpx.HTTPError as err:
            self.fail(kind, f"{type(err).__name__}: {err}")

    async def plain(self, kind: str, n: int) -> None:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        response = await self.http.post(path, json=self.body(kind == "chat", n))
        self.statuses[response.status_code] += 1
        if response.status_code != 200:
            return self.fail(kind, f"{response.status_code} {response.text[:200]}")
        got = response.json()["usage"]["completion_tokens"]
        if got != n or response.json()["choices"][0]["finish_reason"] != "length":
            self.fail(kind, f"asked {n} tokens, got {got} ({response.json()['choices'][0]['finish_reason']})")

    async def stream(self, kind: str, n: int) -> None:
        chat = kind == "chat_stream"
        body = {**self.body(chat, n), "stream": True, "stream_options": {"include_usage": True}}
        async with self.http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as raw:
            self.statuses[raw.status_code] += 1
            if raw.status_code != 200:
                return self.fail(kind, f"{raw.status_code} {(await raw.aread())[:200]!r}")
            lines = [line async for line in raw.aiter_lines() if line]
        if not lines or lines[-1] != "data: [DONE]":
            return self.fail(kind, f"no [DONE]; last line {lines[-1:]!r}")
        usage = json.loads(lines[-2][6:]).get("usage") or {}
        if usage.get("completion_tokens") != n:
            self.fail(kind, f"asked {n} tokens, usage says {usage.get('completion_tokens')}")

    async def disconnect(self, n: int) -> None:
        body = {**self.body(False, max(n, 32)), "stream": True, "threshold": 1.0}
        async with self.http.stream("POST", "/v1/completions", json=body) as raw:
            self.statuses[raw.status_code] += 1
            async for line in raw.aiter_lines():
                if line:
                    break  # drop the connection after the first chunk

    async def abandon(self) -> None:
        body = {**self.body(False, self.max_tokens), "threshold": 1.0}
        try:
            response = await self.http.post("/v1/completions", json=body, timeout=0.05)
            self.statuses[response.status_code] += 1  # finished before the client gave up
        except httpx.TimeoutException:
            self.statuses["abandoned"] += 1

    async def exact(self, kind: str) -> None:
        i = self.rng.randrange(len(EXACT_PROMPTS))
        response = await self.http.post("/v1/completions", json=exact_body(self.model, kind, i))
        self.statuses[response.status_code] += 1
        if response.status_code != 200:
            return self.fail(kind, f"{response.status_code} {response.text[:200]}")
        text = response.json()["choices"][0]["text"]
        if text != self.references[kind, i]:
            self.fail(kind, f"request {i} in a batch gave {text!r}, alone {self.references[kind, i]!r}")

    async def heavy_request(self) -> None:
        body = {**self.body(False, self.max_tokens), **self.heavy.knobs}
        started = time.monotonic()
        response = await self.http.post("/v1/completions", json=body)
        took = time.monotonic() - started
        self.statuses[response.status_code] += 1
        if response.status_code != 200:
            return self.fail("heavy", f"{response.status_code} {response.text[:200]}")
        if took > self.heavy.deadline_s + self.heavy.slack_s:
            self.fail("heavy", f"held its seat {took:.1f} s, past the {self.heavy.deadline_s} s deadline")
        if response.json()["choices"][0]["finish_reason"] not in ("length", "stop"):
            self.fail("heavy", f"finish_reason {response.json()['choices'][0]['finish_reason']}")
        timed_out = response.json()["usage"]["fluxlab"].get("timed_out")
        if timed_out is not (took > self.heavy.deadline_s):
            self.fail("heavy", f"took {took:.1f} s of a {self.heavy.deadline_s} s deadline; usage says timed_out={timed_out}")

    async def bad(self) -> None:
        if self.rng.random() < 0.2:
            raw = self.rng.choice(RAW_BAD)
            response = await self.http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            expected = 400
        else:
            path, body, expected = self.rng.choice(BAD)
            response = await self.http.post(path, json={"model": self.model, **body})
        self.statuses[response.status_code] += 1
        if response.status_code != expected or "error" not in response.json():
            self.fail("bad", f"expected {expected}, got {response.status_code} {response.text[:200]}")


async def run_phase(url: str, model: str, phase: int, seconds: float, max_requests: int, concurrency: int,
                    max_tokens: int, seed: int, pid: Optional[int], headers: dict, references: dict,
                    heavy: Heavy) -> PhaseReport:
    rng = random.Random(seed * 1000 + phase)
    # Its own generator: the i-th request's kind does not depend on how the workers interleave, so
    # a phase of a fixed request count always issues the same mix.
    kinds = random.Random(seed * 1000 + phase + 500)
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as http:
        load = _Load(http, model, rng, max_tokens, references, heavy)
        started = time.monotonic()
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while time.monotonic() - started < seconds and issued < max_requests:
                issued += 1
                await load.one(kinds.choices(KINDS, WEIGHTS)[0])

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - started
        load_info = await _idle_load(http, timeout_s=60)
    if load_info["kv_free_pages"] != load_info["kv_total_pages"] or load_info["num_reqs"]:
        load.fail("pages", f"after the phase: {load_info}")
    return PhaseReport(phase, round(elapsed, 2), issued, dict(load.kinds), {str(k): v for k, v in load.statuses.items()},
                       load.failures, load_info["kv_free_pages"], load_info["kv_total_pages"], rss_mib(pid))


async def _idle_load(http: httpx.AsyncClient, timeout_s: float) -> dict:
    """/get_load once the server has no request left (aborts are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = (await http.get("/get_load")).json()[0]
        idle = info["num_reqs"] == 0 and info["kv_free_pages"] == info["kv_total_pages"]
        if idle or time.monotonic() > deadline:
            return info
        await asyncio.sleep(0.1)


def soak(url: str, model: str, phases: int, phase_seconds: float, max_requests: int, concurrency: int = 8,
         max_tokens: int = 48, seed: int = 0, pid: Optional[int] = None, api_key: Optional[str] = None,
         heavy: Heavy = DEFAULT_HEAVY) -> SoakReport:
    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise ValueError(f"soak only targets loopback addresses, not {url}")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    references = asyncio.run(_solo(url, model, headers))
    report = SoakReport()
    for phase in range(phases):
        report.phases.append(asyncio.run(run_phase(url, model, phase, phase_seconds, max_requests, concurrency,
                                                   max_tokens, seed, pid, headers, references, heavy)))
    return report


async def _solo(url: str, model: str, headers: dict) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=120, headers=headers) as http:
        return await solo_texts(http, model)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server on loopback; default: start `fluxlab serve`")
    parser.add_argument("--pid", type=int, help="the server's pid, for RSS (set when soak starts the server)")
    parser.add_argument("--model", default="tiny_llada2")
    parser.add_argument("--phases", type=int, default=3)
    parser.add_argument("--phase-seconds", type=float, default=20.0)
    parser.add_argument("--max-requests", type=int, default=10_000, help="per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the full report here as JSON")
    parser.add_argument("overrides", nargs="*", help="serve overrides when soak starts the server")
    args = parser.parse_args(argv)

    server = None
    url, pid = args.url, args.pid
    if url is None:
        from fluxlab.bench.server_process import ServerProcess

        log_path = Path(tempfile.mkdtemp(prefix="fluxlab-soak-")) / "serve.log"
        server = ServerProcess(list(args.overrides), log_path, timeout_s=600)
        url, pid = server.url, server.pid
    try:
        report = soak(url, args.model, args.phases, args.phase_seconds, args.max_requests, args.concurrency,
                      args.max_tokens, args.seed, pid)
    finally:
        if server is not None:
            server.stop()
    print(report.table())
    for failure in report.failures[:20]:
        print("FAIL", failure)
    if args.out:
        args.out.write_text(json.dumps([asdict(p) for p in report.phases], indent=2))
    return 1 if report.failures or report.server_errors else 0


if __name__ == "__main__":
    sys.exit(main())
