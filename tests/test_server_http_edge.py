"""The HTTP edge with hostile or clumsy clients (issue 35): the key is checked before the body is
read, slow senders lose their connection, and a refused body is an answer every client sees."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest

from server_helpers import MODEL, TINY, ServerProcess, fake_app

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
READ_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(TINY + [f"server.api_key={KEY}", "server.max_request_body_bytes=1000000",
                                 f"server.client_read_timeout_s={READ_TIMEOUT_S}"], tmp_path_factory.mktemp("edge"))
    yield proc
    proc.stop()


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


# ------------------------------------------------------------------------------------ the API key (in process)

def _ask(overrides: list[str], *requests: tuple[str, str, dict]) -> list[httpx.Response]:
    app, async_engine = fake_app(overrides)

    async def main():
        async_engine.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                return [await http.request(method, path, **kwargs) for method, path, kwargs in requests]
        finally:
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    return asyncio.run(main())


def test_the_docs_and_the_openapi_document_need_the_key():
    paths = ("/docs", "/redoc", "/openapi.json", "/no/such/path")
    without = _ask([f"server.api_key={KEY}"], *[("GET", p, {}) for p in paths])
    for path, response in zip(paths, without):
        assert_error(response, 401, "invalid_api_key")
    with_key = _ask([f"server.api_key={KEY}"], *[("GET", p, {"headers": AUTH}) for p in paths])
    assert [r.status_code for r in with_key] == [200, 200, 200, 404]
    assert with_key[2].json()["paths"]["/v1/completions"]
    # without a configured key everything stays open
    assert [r.status_code for r in _ask([], *[("GET", p, {}) for p in paths[:3]])] == [200, 200, 200]


def test_the_key_is_checked_before_the_body_is_parsed():
    bad_json = {"content": b'{"model": "tiny_llada2", "prompt": ', "headers": {"content-type": "application/json"}}
    without, wrong, with_key, health = _ask(
        [f"server.api_key={KEY}"], ("POST", "/v1/completions", bad_json),
        ("POST", "/v1/completions", {**bad_json, "headers": {**bad_json["headers"], "Authorization": "Bearer no"}}),
        ("POST", "/v1/completions", {**bad_json, "headers": {**bad_json["headers"], **AUTH}}),
        ("GET", "/health", {}))
    assert_error(without, 401, "invalid_api_key")
    assert_error(wrong, 401, "invalid_api_key")
    assert with_key.status_code == 400  # parsed only once the key is right
    assert health.status_code == 200


# ------------------------------------------------------------------------------------ refused bodies, async clients

def test_a_body_over_the_limit_is_a_413_for_async_clients(server):
    prompt = "x" * 10_000_000

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as http:
            declared = await http.post("/v1/completions", json={**GOOD, "prompt": prompt})

            async def chunked():  # no Content-Length: counted as it arrives
                for _ in range(40):
                    yield b"x" * 250_000

            streamed = await http.post("/v1/completions", content=chunked(),
                                       headers={"content-type": "application/json"})
            after = await http.post("/v1/completions", json=GOOD)  # the connection (or a new one) serves on
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        try:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        finally:
            await client.close()
        return declared, streamed, after, refused.value

    declared, streamed, after, refused = asyncio.run(main())
    assert "server.max_request_body_bytes=1000000" in assert_error(declared, 413, "request_too_large")["message"]
    assert_error(streamed, 413, "request_too_large")
    assert after.status_code == 200
    assert refused.status_code == 413


def test_an_unauthenticated_large_body_is_a_401_for_async_clients(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={**GOOD, "prompt": "x" * 900_000})
                                          for _ in range(4)), http.get("/health"))

    *refused, health = asyncio.run(main())
    for response in refused:
        assert_error(response, 401, "invalid_api_key")
    assert health.status_code == 200


# ------------------------------------------------------------------------------------ slow clients (raw sockets)

def _closed_by_server(sock: socket.socket, timeout_s: float) -> bytes:
    """What the server sent before it closed the connection; fails if it is still open after timeout_s."""
    sock.settimeout(timeout_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except socket.timeout:
        pytest.fail(f"the server kept the connection open for {timeout_s} s (received {received[:200]!r})")
    except ConnectionResetError:
        pass
    return received


def test_sockets_that_stall_in_their_headers_or_body_are_closed(server):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    silent = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    partial_head = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    partial_body = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    try:
        for sock in partial_head:
            sock.sendall(head[:40])
        for sock in partial_body:
            sock.sendall(head + b'{"model": ')
        for sock in silent + partial_head:
            assert _closed_by_server(sock, 30 * READ_TIMEOUT_S) == b""
        for sock in partial_body:
            answer = _closed_by_server(sock, 30 * READ_TIMEOUT_S)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_timeout" and "server.client_read_timeout_s" in error["message"]
    finally:
        for sock in silent + partial_head + partial_body:
            sock.close()
    assert server.get("/health").status_code == 200


def test_a_body_sent_in_slow_pieces_within_the_timeout_is_served(server):
    """The timeout is per piece, not for the whole body."""
    body = f'{{"model": "{MODEL}", "prompt": "hello", "max_tokens": 4}}'.encode()
    pieces = [body[i:i + 12] for i in range(0, len(body), 12)]
    assert len(pieces) * READ_TIMEOUT_S / 2 > READ_TIMEOUT_S

    def trickle():
        for piece in pieces:
            yield piece
            time.sleep(READ_TIMEOUT_S / 2)

    response = httpx.post(server.url + "/v1/completions", content=trickle(), timeout=120,
                          headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
