"""hs-serve against a live server on loopback (uvicorn in a thread): the official `openai` client for
chat, completions, streaming, stop, n, seed reproducibility and logprobs; raw HTTP for every error case;
a client that disconnects mid-stream frees its slot; /metrics counts move."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
import openai  # noqa: E402

from hybridsparse.runtime import server as S  # noqa: E402
from tiny_models import tiny_llama  # noqa: E402

KEY = "sk-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(base: str, status: int | None = None, tries: int = 400) -> httpx.Response | None:
    """Poll /health until it answers (with `status`, when given); the last answer."""
    r = None
    for _ in range(tries):
        try:
            r = httpx.get(base + "/health")
            if status is None or r.status_code == status:
                return r
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return r


@contextlib.contextmanager
def serving(app, ready: int | None = 200):
    """The app under uvicorn in a thread on a free loopback port; yields its base URL once /health
    answers (with status `ready`, when given); stops the server afterwards."""
    import uvicorn
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_health(base, ready)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    from hybridsparse.runtime.loader import open_model
    path = tiny_llama(tmp_path_factory.mktemp("srv") / "tiny.gguf")
    args = S.build_parser().parse_args(["-m", str(path), "-np", "2", "-c", "128", "--api-key", KEY, "--alias", "tiny",
                                        "-t", "1", "--no-graphs"])
    with serving(S.create_app(args, lambda: open_model(path, 0))) as base:
        yield base


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live + "/v1", api_key=KEY, max_retries=0)


def test_models_and_chat(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    again = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                           temperature=0)
    assert again.choices[0].message.content == r.choices[0].message.content  # greedy is deterministic


def test_seed_n_and_logprobs(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "a story"}], max_tokens=12, temperature=1.0, seed=7)
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=3, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # n choices are different draws
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)


def test_streaming_and_stop(client):
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                          temperature=0)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    if len(text) > 3:
        stop = text[2:4]
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10,
                                           temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content


def test_completions_prompt_forms_echo_and_logprobs(client):
    r = client.completions.create(model="tiny", prompt="The", max_tokens=5, temperature=0)
    ids = httpx.post(str(client.base_url).replace("/v1/", "/tokenize"), json={"content": "The", "add_special": True},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text
    multi = client.completions.create(model="tiny", prompt=["The", "A"], max_tokens=3, temperature=0)
    assert len(multi.choices) == 2 and multi.choices[0].text == r.choices[0].text[: len(multi.choices[0].text)]
    e = client.completions.create(model="tiny", prompt="The cat", max_tokens=0, echo=True, logprobs=2)
    lp = e.choices[0].logprobs
    assert e.choices[0].text.endswith("The cat") and lp.token_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and len(lp.tokens) == e.usage.prompt_tokens


def _post(live, path, body, key=KEY, raw=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(live + path, content=raw if raw is not None else json.dumps(body), headers=headers)


@pytest.mark.parametrize("body,status,needle", [
    (None, 400, "not valid JSON"),
    ([1, 2], 400, "JSON object"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "'n'"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": 3}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, 400, "context"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-4"}, 404, "does not exist"),
])
def test_bad_requests(live, body, status, needle):
    r = _post(live, "/v1/chat/completions", body, raw=b"{not json" if body is None else None)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_auth_routes_and_unknown_fields(live):
    assert _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, key=None).status_code == 401
    assert _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, key="wrong").status_code == 401
    assert httpx.get(live + "/v1/nothing", headers={"Authorization": f"Bearer {KEY}"}).status_code == 404
    ok = _post(live, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
                                              "frobnicate": {"a": 1}})
    assert ok.status_code == 200  # unknown request fields are ignored
    assert _post(live, "/v1/completions", {"prompt": [10**9]}).status_code == 400
    assert _post(live, "/detokenize", {"tokens": [-1]}).status_code == 400
    ids = _post(live, "/tokenize", {"content": "hello"}).json()["tokens"]
    assert _post(live, "/detokenize", {"tokens": ids}).json()["content"] == "hello"
    assert httpx.get(live + "/").status_code == 200 and "<textarea" in httpx.get(live + "/").text


def _metric(live, name) -> float:
    text = httpx.get(live + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"hybridsparse:{name} ")))


def test_disconnect_frees_the_slot_and_metrics_move(live, client):
    before = _metric(live, "tokens_predicted_total")
    for _ in range(3):  # more abandoned streams than slots: each must give its slot back
        with httpx.stream("POST", live + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"messages": [{"role": "user", "content": "go"}], "max_tokens": 100, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                    break
    for _ in range(100):
        if _metric(live, "requests_processing") == 0:
            break
        time.sleep(0.05)
    assert _metric(live, "requests_processing") == 0
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "still there?"}], max_tokens=3)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert _metric(live, "tokens_predicted_total") > before and _metric(live, "prompt_tokens_total") > 0


def test_concurrent_clients_are_batched_and_get_the_solo_answer(client, live):
    """Six clients at once on two slots: decoded in batches (forward_batch), each greedy answer equal
    to the one a lone client gets."""
    def ask(i):
        return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"n{i % 3}"}],
                                              max_tokens=12, temperature=0).choices[0].message.content
    solo = [ask(i) for i in range(3)]
    results = [None] * 6

    def one(i):
        results[i] = ask(i)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [solo[i % 3] for i in range(6)]


def test_chat_page_in_a_real_browser(live):
    """Debian's chromium (headless, through selenium and chromedriver) loads the page, sends a message
    and shows the streamed reply. Skips where chromium is not installed (`apt-get install chromium
    chromium-driver`), unless HS_REQUIRE_BROWSER=1 (CI), where that fails."""
    import os
    import shutil
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        if os.environ.get("HS_REQUIRE_BROWSER") == "1":
            pytest.fail("HS_REQUIRE_BROWSER=1 but chromium / chromedriver are not on PATH")
        pytest.skip("chromium / chromedriver not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    opts = webdriver.ChromeOptions()
    opts.binary_location = shutil.which("chromium")
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=opts)
    try:
        driver.get(live + "/")
        driver.find_element(By.ID, "key").send_keys(KEY)
        WebDriverWait(driver, 20).until(lambda d: d.find_element(By.ID, "model").text == "tiny")
        driver.find_element(By.ID, "max").clear()
        driver.find_element(By.ID, "max").send_keys("12")
        driver.find_element(By.ID, "input").send_keys("Hello there")
        driver.find_element(By.ID, "send").click()
        WebDriverWait(driver, 60).until(lambda d: d.find_element(By.ID, "send").is_enabled()
                                        and d.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        bubbles = driver.find_elements(By.CSS_SELECTOR, ".msg")
        assert [b.get_attribute("class") for b in bubbles] == ["msg user", "msg assistant"]
        assert bubbles[0].text == "Hello there" and bubbles[1].text  # the streamed reply is on the page
        assert "chunks" in driver.find_element(By.ID, "stats").text
    finally:
        driver.quit()


def test_load_test_command(tmp_path):
    """hs-bench serve, bounded: a server of its own on loopback, concurrent streaming clients, no failure."""
    from hybridsparse.runtime import bench
    model = tiny_llama(tmp_path / "tiny.gguf")
    out = tmp_path / "serve.json"
    assert bench.main(["serve", "-m", str(model), "-t", "1", "--clients", "4", "--duration", "2",
                       "--single-duration", "1", "--max-tokens", "8", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    c = r["concurrent"]
    assert c["failed"] == 0 and c["requests"] >= 4 and c["ttft_p50_s"] > 0 and r["single"]["generated_tokens"] > 0
    assert r["server_rss_mib_after"] > 0


def test_503_while_loading_then_ready(tmp_path):
    """/health and the API answer 503 while the model loads, then serve; a model that fails to load
    is reported, not hung on."""
    from hybridsparse.runtime.loader import open_model
    path = tiny_llama(tmp_path / "tiny.gguf")
    gate = threading.Event()

    def slow_load():
        gate.wait(30)
        return open_model(path, 0)
    args = S.build_parser().parse_args(["-m", str(path), "-np", "1", "-c", "64", "-t", "1", "--no-graphs"])
    with serving(S.create_app(args, slow_load), ready=None) as base:
        r = wait_health(base)
        assert r.status_code == 503 and r.json()["status"] == "loading model"
        busy = httpx.post(base + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert busy.status_code == 503 and busy.json()["error"]["message"] == "loading model"
        gate.set()
        wait_health(base, 200)
        assert httpx.post(base + "/v1/completions", json={"prompt": "a", "max_tokens": 2}).status_code == 200

    def broken():
        raise OSError("disk on fire")
    with serving(S.create_app(args, broken), ready=None) as base:
        r = wait_health(base, 500)
        assert r.status_code == 500 and "disk on fire" in r.json()["error"]


def test_serve_flags_are_checked_before_listening(tmp_path, capsys):
    assert S.main(["-m", str(tmp_path / "nope.gguf")]) == 1
    assert "no such model file" in capsys.readouterr().err
    path = tiny_llama(tmp_path / "tiny.gguf")
    for bad, needle in ((["-np", "0"], "-np 0"), (["-c", "4"], "-c 4"), (["--port", "70000"], "--port 70000"),
                        (["-b", "0"], "-b 0")):
        assert S.main(["-m", str(path)] + bad) == 1
        assert needle in capsys.readouterr().err


def test_hybrid_placement_served_in_batches_gives_the_dense_answers(tmp_path, client):
    """The server over the hybrid runtime (CPU-only, oracle active sets: exact for this ReLU model),
    three clients at once so their tokens go through the split FFN as one batch: the same greedy
    answers as the dense server."""
    from hybridsparse.runtime.hybrid import HybridOptions
    from hybridsparse.runtime.loader import open_model
    path = tiny_llama(tmp_path / "tiny.gguf")  # the same weights as the `live` server's model
    args = S.build_parser().parse_args(["-m", str(path), "-np", "3", "-c", "128", "-t", "1", "--alias", "tiny",
                                        "--no-graphs"])
    app = S.create_app(args, lambda: open_model(path, hybrid=HybridOptions(mode="oracle", vram_budget=0),
                                                log_line=lambda *_: None))
    prompts = ["alpha", "beta gamma", "delta"]
    want = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=10,
                                           temperature=0).choices[0].message.content for p in prompts]
    got = [None] * 3
    with serving(app) as base:
        hyb = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)

        def one(i):
            got[i] = hyb.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompts[i]}],
                                                 max_tokens=10, temperature=0).choices[0].message.content
        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert got == want


def test_a_step_reads_at_most_batch_size_prompt_tokens_and_decoding_goes_on(tmp_path):
    """Three long prompts arrive while a sequence decodes: with -b 16 no step feeds more than 16 prompt
    tokens in all (oldest sequence first), the decoding sequence gets a token in every step, and
    every answer is the one the sequence gets alone."""
    import asyncio

    from hybridsparse.runtime.loader import open_model
    from hybridsparse.runtime.sampling import SamplingParams
    path = tiny_llama(tmp_path / "tiny.gguf")
    lm = open_model(path, 0)
    loop = asyncio.new_event_loop()
    prompts = [list(range(3, 8)), list(range(10, 50)), list(range(20, 60)), list(range(30, 70))]

    def run(engine, which):
        seqs = [S.Seq(prompts[i], SamplingParams(temperature=0), 12, [], None, asyncio.Queue(), loop) for i in which]
        for seq in seqs:
            engine.submit(seq)
            time.sleep(0.02 if seq is seqs[0] else 0)  # the first one is decoding when the others come

        async def collect(seq):
            out = []
            while True:
                ev = await seq.events.get()
                if ev.get("finish") or ev.get("error"):
                    return out
                out.append(ev["token"])
        async def all_of():
            return await asyncio.gather(*(collect(q) for q in seqs))
        return loop.run_until_complete(all_of())

    solo = []
    for i in range(4):
        e = S.Engine(lm, 1, 128, 16, use_graphs=False)
        solo += run(e, [i])
        e.close()
    engine = S.Engine(lm, 4, 128, 16, use_graphs=False)
    steps = []
    real_run = engine._run
    engine._run = lambda batch: (steps.append([(s.fed < len(s.prompt), len(t)) for s, t in batch]), real_run(batch))
    together = run(engine, [0, 1, 2, 3])
    engine.close()
    loop.close()
    assert together == solo
    assert max(sum(n for reading, n in st if reading) for st in steps) <= 16
    assert sum(n for st in steps for reading, n in st if reading) == sum(map(len, prompts))
    # the steps that fed the long prompts also carried a decode token (the first sequence's, or later ones')
    assert sum(1 for st in steps if any(r for r, _ in st) and any(not r for r, _ in st)) >= 3
