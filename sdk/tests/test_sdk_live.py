"""The SDK against the real stack (uvicorn, Celery worker, Postgres, Redis, sandboxes)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import hedgerow
import httpx
import pytest
from hedgerow import AsyncClient, Client

from apps.orchard.tests.live import wait_all_deleted
from apps.sandboxes.models import Operation, Sandbox, State

pytestmark = pytest.mark.timeout(240)
SDK_DIR = Path(__file__).resolve().parents[1]


def test_it_runs_a_sandbox_through_the_sync_client(live, make_tenant, tmp_path):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr:
        with hr.create_sandbox(labels={"suite": "sdk"}) as sandbox:
            assert sandbox.state == "ready"
            result = sandbox.exec(["sh", "-c", "echo out; echo err >&2; exit 3"])
            assert (result.exit_code, result.signal, result.timed_out) == (3, None, False)
            assert (result.stdout, result.stderr) == ("out\n", "err\n")
            assert result.stdout_info.total_bytes == 4 and not result.stdout_info.truncated
            assert result.usage["wall_s"] >= 0
            timed = sandbox.exec("sleep 20", timeout=0.5)
            assert timed.timed_out and timed.exit_code is None
            seen: list[str] = []
            sandbox.exec("echo streamed", on_stdout=seen.append)
            assert "".join(seen) == "streamed\n"
            assert sandbox.exec("cat", stdin=b"piped").stdout == "piped"

            big = os.urandom(3 * 1024 * 1024 + 7)
            sandbox.write_file("/workspace/big.bin", big)
            assert sandbox.read_file("/workspace/big.bin") == big

            tree = tmp_path / "tree"
            (tree / "a" / "b").mkdir(parents=True)
            (tree / "top.txt").write_text("top")
            (tree / "a" / "b" / "deep.txt").write_text("deep")
            sent: list[int] = []
            assert sandbox.upload(tree, "/workspace/tree", progress=sent.append) == 7
            assert sum(sent) == 7
            back = tmp_path / "back"
            assert sandbox.download("/workspace/tree", back) == 7
            assert (back / "a" / "b" / "deep.txt").read_text() == "deep"
            assert (back / "top.txt").read_text() == "top"
            assert {e["name"] for e in sandbox.list_files("/workspace/tree")} == {"a", "top.txt"}

            sandbox.write_file("/workspace/app.py", "x = 1\n")
            patched = sandbox.apply_patch(
                "--- a/app.py\n+++ b/app.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"
            )
            assert patched.ok, patched.stderr
            assert sandbox.read_file("/workspace/app.py") == b"x = 2\n"
            assert not sandbox.apply_patch("--- a/app.py\n+++ b/app.py\n@@ -1 +1 @@\n-q\n+r\n").ok

            sandbox.heartbeat()
            assert sandbox.operation(result.operation_id).exit_code == 3
            assert [s.id for s in hr.list()] == [sandbox.id]
            sandbox_id = sandbox.id
    record = Sandbox.objects.get(tenant=tenant, external_id=sandbox_id)
    assert record.state in (State.TERMINATING, State.DELETED)
    assert record.labels == {"suite": "sdk"}
    wait_all_deleted(tenant)


def test_it_types_errors_from_the_real_server(live, make_tenant):
    tenant, secret = make_tenant()
    with pytest.raises(hedgerow.AuthError) as auth:
        Client(live.url, "hr_nope", cleanup=False).list()
    assert auth.value.status == 401
    with Client(live.url, secret) as hr:
        with pytest.raises(hedgerow.NotFound):
            hr.get("missing")
        with pytest.raises(hedgerow.ValidationError) as invalid:
            hr.create_sandbox("Not A Reference!")  # image_reference_invalid, a 400
        assert invalid.value.field == "image"
        sandbox = hr.create_sandbox(sandbox_id="fixed-id")
        with pytest.raises(hedgerow.Conflict):
            hr.create_sandbox(sandbox_id="fixed-id")
        Sandbox.objects.filter(tenant=tenant, external_id="fixed-id").update(state=State.LOST)
        with pytest.raises(hedgerow.SandboxLost):
            sandbox.exec("true")
        Sandbox.objects.filter(tenant=tenant, external_id="fixed-id").update(state=State.READY)
        sandbox.delete()
        with pytest.raises(hedgerow.SandboxTerminating):
            sandbox.exec("true")
    wait_all_deleted(tenant)


def test_it_runs_sandboxes_in_parallel_through_the_async_client(live, make_tenant):
    tenant, secret = make_tenant()

    async def rollout(hr: AsyncClient, n: int) -> str:
        async with await hr.create_sandbox() as sandbox:
            await sandbox.write_file("/workspace/n.txt", str(n))
            result = await sandbox.exec("cat /workspace/n.txt")
            assert (await sandbox.read_file("/workspace/n.txt")) == str(n).encode()
            return result.stdout

    async def main() -> list[str]:
        async with AsyncClient(live.url, secret) as hr:
            outputs = await asyncio.gather(*(rollout(hr, n) for n in range(3)))
            kept = await hr.create_sandbox()  # left for the client's own cleanup
            assert (await kept.exec("echo kept")).stdout == "kept\n"
            return list(outputs)

    assert sorted(asyncio.run(main())) == ["0", "1", "2"]
    states = set(Sandbox.objects.filter(tenant=tenant).values_list("state", flat=True))
    assert states <= {State.TERMINATING, State.DELETED}
    assert Sandbox.objects.filter(tenant=tenant).count() == 4
    wait_all_deleted(tenant)


class _DroppingProxy:
    """Forwards HTTP to the stack, but for the first exec it drops the response after
    the server has run the command (the client sees a broken connection)."""

    def __init__(self, upstream: str) -> None:
        self.dropped = 0
        self.exec_requests = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                return

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")
                }
                with httpx.Client(trust_env=False, timeout=120) as http:
                    upstream_response = http.request(
                        self.command, upstream + self.path, content=body, headers=headers
                    )
                if self.command == "POST" and self.path.endswith("/exec"):
                    proxy.exec_requests += 1
                    if proxy.dropped == 0:
                        proxy.dropped += 1
                        self.close_connection = True
                        self.connection.close()
                        return
                content = upstream_response.content
                self.send_response(upstream_response.status_code)
                for key, value in upstream_response.headers.items():
                    if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_retried_exec_never_runs_twice_when_its_response_is_lost(live, make_tenant):
    tenant, secret = make_tenant()
    proxy = _DroppingProxy(live.url)
    try:
        with Client(proxy.url, secret) as hr, hr.create_sandbox() as sandbox:
            result = sandbox.exec("echo ran >> /workspace/count; wc -l < /workspace/count")
            assert (proxy.dropped, proxy.exec_requests) == (1, 2)
            assert result.stdout.strip() == "1"
            assert sandbox.read_file("/workspace/count") == b"ran\n"
            operations = Operation.objects.filter(sandbox__external_id=sandbox.id)
            assert operations.count() == 1
            assert operations.get().operation_id == result.operation_id
    finally:
        proxy.close()
    wait_all_deleted(tenant)


def _script(live, secret: str, *, cleanup: bool) -> subprocess.Popen[str]:
    code = textwrap.dedent(
        f"""
        import sys, time
        from hedgerow import Client
        hr = Client(cleanup={cleanup})
        sandbox = hr.create_sandbox()
        print(sandbox.id, flush=True)
        time.sleep(120)
        """
    )
    env = {
        **os.environ,
        "HEDGEROW_URL": live.url,
        "HEDGEROW_API_KEY": secret,
        "PYTHONPATH": str(SDK_DIR),
    }
    return subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True
    )


def test_it_deletes_its_sandboxes_on_sigterm_unless_told_not_to(live, make_tenant):
    tenant, secret = make_tenant()
    proc = _script(live, secret, cleanup=True)
    kept = _script(live, secret, cleanup=False)
    try:
        cleaned_id = proc.stdout.readline().strip()
        kept_id = kept.stdout.readline().strip()
        assert cleaned_id and kept_id
        proc.send_signal(signal.SIGTERM)
        kept.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM  # still dies of the signal
        assert kept.wait(timeout=60) == -signal.SIGTERM
    finally:
        for p in (proc, kept):
            if p.poll() is None:
                p.kill()
    cleaned = Sandbox.objects.get(tenant=tenant, external_id=cleaned_id)
    assert cleaned.state in (State.TERMINATING, State.DELETED)
    assert Sandbox.objects.get(tenant=tenant, external_id=kept_id).state == State.READY
    Client(live.url, secret, cleanup=False).delete(kept_id)
    wait_all_deleted(tenant)


def test_create_sandbox_takes_an_egress_policy(live, make_tenant):
    tenant, secret = make_tenant()
    with Client(live.url, secret) as hr:
        with hr.create_sandbox(egress={"allow": ["pkg.example.org"]}) as sandbox:
            assert sandbox.data["egress"] == {"allow": ["pkg.example.org"], "dns": "filtered"}
            assert sandbox.data["network_access"] is True
        with pytest.raises(hedgerow.ValidationError) as caught:
            hr.create_sandbox(egress="everything", wait=False)
    assert caught.value.code == "validation_error"
    assert Sandbox.objects.filter(tenant=tenant).count() == 1
