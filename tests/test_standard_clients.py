"""Standard clients work as docs/bench.md prints them ("Other clients"): aiperf and lm-eval against a
served embedded model. The commands are read out of the doc's code blocks, so a doc edit that breaks
them breaks this test; the only changes are the port (the server's own, free one) and the size of
the run (16 requests, `--limit 16`), to keep each test under a minute on two CPU cores.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fluxlab.config import PROJECT_ROOT
import aiperf_venv
from server_helpers import ServerProcess

DOC = Path(PROJECT_ROOT) / "docs" / "bench.md"
DOC_PORT = "8931"
SERVE = "fluxlab serve server.host=127.0.0.1 server.port=8931"
WAIT = "until curl -sf"


def doc_block(marker: str) -> str:
    """The code block of the "Other clients" section that holds `marker`."""
    text = DOC.read_text()
    section = text[text.index("## Other clients"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"^```\n(.*?)^```", section, re.S | re.M)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"docs/bench.md 'Other clients' should have one code block with {marker!r}"
    return found[0]


def client_script(block: str, port: int) -> str:
    """The block without its first two lines (start the server, wait for /health: the fixture does
    both, with the same overrides), on the server's port."""
    lines = block.splitlines()
    assert lines[0] == SERVE + " &" and lines[1].startswith(WAIT), block
    return "\n".join(lines[2:]).replace(DOC_PORT, str(port)) + "\n"


def run_script(script: str, cwd: Path, timeout_s: float = 300, extra_path: str = "") -> subprocess.CompletedProcess:
    # `python` in the doc is the one fluxlab is installed in; extra_path (aiperf's venv) comes after it
    path = os.pathsep.join(p for p in (str(Path(sys.executable).parent), os.environ.get("PATH", ""), extra_path) if p)
    env = {**os.environ, "PATH": path}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the doc's `fluxlab serve server.host=127.0.0.1 server.port=8931`, on a free port
    proc = ServerProcess(["server.host=127.0.0.1", "server.port=0", "server.log_level=warning"],
                         tmp_path_factory.mktemp("clients"))
    yield proc
    proc.stop()


def test_aiperf_profiles_the_held_out_prompts_as_printed(server, tmp_path):
    bin_dir = aiperf_venv.ensure()  # waits for the build conftest.py started, if it is still running
    script = client_script(doc_block("aiperf profile"), server.port)
    assert "--request-count 128" in script
    result = run_script(script.replace("--request-count 128", "--request-count 16"), tmp_path, extra_path=bin_dir)
    tail = (result.stdout + result.stderr)[-4000:]
    assert result.returncode == 0, tail
    (export,) = tmp_path.glob("artifacts/*/profile_export_aiperf.json")
    summary = json.loads(export.read_text())
    assert summary["request_count"]["avg"] == 16, tail
    assert not summary.get("error_summary"), summary.get("error_summary")
    assert summary["output_sequence_length"]["min"] >= 1  # every reply had content


def test_lm_eval_scores_the_held_out_split_as_printed(server, tmp_path):
    for module in ("lm_eval", "tenacity"):  # tenacity: lm-eval's [api] extra, for its API models
        if importlib.util.find_spec(module) is None:
            pytest.fail(f"{module} is not installed: the test extra has it (pip install -e '.[test]', lm-eval[api]==0.4.13)")
    script = client_script(doc_block("lm_eval --model local-chat-completions"), server.port)
    result = run_script(script.rstrip("\n") + " --limit 16\n", tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    row = re.search(r"^\|fluxlab_arith\|.*\|acc\s*\|.\s*\|\s*([0-9.]+)\|", out, re.M)
    assert row, out[-4000:]
    assert float(row.group(1)) >= 0.9, out[-4000:]  # the embedded model gets 127 of the 128 right
