#!/usr/bin/env python3
"""End-to-end test of `moelora serve` with the official OpenAI Python client.

Checks that the server speaks the OpenAI API the way real clients expect it (model listing,
completions, chat, streaming with usage, adapter selection in its three spellings, error types,
seeded sampling, stop strings, API keys, Prometheus metrics) and that it stays correct under load
while a runtime adapter is loaded and unloaded over and over. The model and the adapters are tiny
random ones written by `moelora synth` / `moelora synth-adapter` into a temporary folder, so the
test needs no downloads and runs on the CPU engine.

    .deps/pyclient/bin/python tests/serve/openai_client_test.py --moelora build/moelora \\
        [--device cpu|cuda]

Needs the `openai` and `prometheus-client` packages (scripts/setup puts them in .deps/pyclient).
Every server subprocess is stopped at the end; on failure the server logs are printed.

On the GPU (--device cuda, with e.g. --preset small-qwen3-moe --all-experts for the larger-model
run of the GPU host) a greedy answer served in a batch may leave its answer alone at a near-tie of
the logits (bf16 GEMMs of another batch size round differently). There the load test compares
token by token with log-probabilities (--compare near-tie, the default on cuda): up to the first
difference the tokens must be equal, and there the batched token must be among the alone run's
top alternatives within NEAR_TIE_NATS of its best; at least half of the answers must be identical.
--all-experts routes every token through all experts, so that a near-tie of the router cannot
flip an expert choice instead.

With --sanitized (a binary built with AddressSanitizer) the load test cannot judge memory by the
resident size, because ASan keeps freed blocks in its quarantine and its allocator caches on
purpose; there every server must instead stop with exit code 0 after SIGTERM, which
LeakSanitizer turns nonzero (and reports in the server log) if anything allocated was never freed.
"""

import argparse
import atexit
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

import openai
from prometheus_client.parser import text_string_to_metric_families

ARGS = None  # parsed command line, set in main()
BASE = "model"  # served name of the base model: the folder name of the synthesized checkpoint
STABLE_ADAPTERS = ("sql", "chat3d")  # registered at start: PEFT 2-D and peft-3d layouts
CHURN_ADAPTER = "churn"  # loaded and unloaded at run time from --lora-root
MAX_TOKENS = 12
NEAR_TIE_NATS = 0.25  # see the module docstring (the same bound as tests/gpu/serve_gpu_test.cpp)
TOP_ALTERNATIVES = 5


def sigterm_grace_s():
    # LeakSanitizer's scan at exit takes a few seconds on a sanitized binary.
    return 30 if ARGS.sanitized else 3


class Server:
    """One `moelora serve --port 0` subprocess; its output goes to a log file."""

    all_servers = []

    def __init__(self, workdir, name, extra_args):
        self.log_path = os.path.join(workdir, f"{name}.log")
        self.name = name
        cmd = [ARGS.moelora, "serve", "--model", os.path.join(workdir, BASE), "--port", "0",
               "--device", ARGS.device] + extra_args
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        Server.all_servers.append(self)
        self.url = self._wait_listening(timeout=60)

    def _wait_listening(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path) as f:
                m = re.search(r"moelora serve: listening on (http://\S+)", f.read())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server '{self.name}' exited with {self.proc.returncode} "
                                   f"before listening:\n{self.read_log()}")
            time.sleep(0.05)
        raise RuntimeError(f"server '{self.name}' did not print its port within {timeout} s:\n"
                           f"{self.read_log()}")

    def client(self, api_key="unused", timeout=60):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=timeout)

    def get(self, path):
        """GET a non-API route; returns (status, body text)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def post(self, path, body):
        """POST JSON to a route the client has no method for; returns (status, body text)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def read_log(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self):
        """SIGTERM, then the exit code (None when it had to be killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=sigterm_grace_s())
            except subprocess.TimeoutExpired:
                # test_sigterm_stops_the_server checks a clean stop; here just make sure it ends.
                print(f"warning: server '{self.name}' still running {sigterm_grace_s()} s after "
                      "SIGTERM; killed", file=sys.stderr)
                self.proc.kill()
                self.proc.wait()
                return None
        if not self.log.closed:
            self.log.close()
        return self.proc.returncode


def resident_bytes(pid):
    """VmRSS of a process (Linux /proc)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def stop_all_servers():
    for s in Server.all_servers:
        s.stop()


atexit.register(stop_all_servers)

WORKDIR = None
SERVER = None


def run_tool(*args):
    subprocess.run([ARGS.moelora, *args], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)


def setUpModule():
    global WORKDIR, SERVER
    WORKDIR = tempfile.mkdtemp(prefix="moelora_openai_")
    model = os.path.join(WORKDIR, BASE)
    tokenizer = os.path.join(os.path.dirname(__file__), "..", "data", "tokenizer")
    run_tool("synth", "--preset", ARGS.preset, "--seed", "3", "--out", model,
             "--tokenizer", tokenizer)
    if ARGS.all_experts:
        config_path = os.path.join(model, "config.json")
        with open(config_path) as f:
            config = json.load(f)
        config["num_experts_per_tok"] = config["num_experts"]
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
    adapter = lambda out, seed, *extra: run_tool(  # noqa: E731
        "synth-adapter", "--model", model, "--targets", "all", "--rank", "8", "--seed", str(seed),
        "--out", out, *extra)
    adapter(os.path.join(WORKDIR, "lora_sql"), 11)
    adapter(os.path.join(WORKDIR, "lora_chat3d"), 12, "--layout", "peft-3d")
    os.makedirs(os.path.join(WORKDIR, "lora_root"))
    adapter(os.path.join(WORKDIR, "lora_root", "churn_dir"), 13)
    SERVER = Server(WORKDIR, "main", [
        "--adapter", f"sql={WORKDIR}/lora_sql", "--adapter", f"chat3d={WORKDIR}/lora_chat3d",
        "--enable-lora-updates", "--lora-root", os.path.join(WORKDIR, "lora_root")])


def tearDownModule():
    stop_all_servers()

PROMPTS = [[1, 5, 9, 200, 17], [300, 301, 302], [42] * 7, [7, 8, 9, 10, 11, 12, 13, 14, 15]]
CHAT = [{"role": "user", "content": "Write a haiku about experts."}]


def greedy_completion(client, model, prompt, extra_body=None, max_tokens=MAX_TOKENS):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, extra_body=extra_body)
    return r.choices[0].text


def greedy_signature(client, model, prompt, extra_body=None):
    """A greedy completion as (text, log-probabilities of its tokens): two answers with the same
    text can still come from different models (a random model's tokens often decode to the same
    replacement characters), their log-probabilities cannot."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True, **(extra_body or {})})
    return r.choices[0].text, tuple(r.choices[0].logprobs.token_logprobs)


def greedy_completion_stream(client, model, prompt, max_tokens=MAX_TOKENS):
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True)
    return "".join(c.choices[0].text for c in stream if c.choices)


class Answer:
    """A greedy answer: its text and, when asked with log-probabilities, per generated token its
    text, its log-probability and the best log-probability of each top alternative text."""

    def __init__(self, text, tokens=None, logprobs=None, alternatives=None):
        self.text = text
        self.tokens = tokens
        self.logprobs = logprobs
        self.alternatives = alternatives

    def __repr__(self):
        return repr(self.text)


def completion_logprob_answer(chunks):
    """Answer from the choices of a completion (one, or the chunks of a stream)."""
    text, tokens, logprobs, alternatives = "", [], [], []
    for c in chunks:
        text += c.text
        lp = c.logprobs
        if lp is None or not lp.tokens:
            continue
        tokens += lp.tokens
        logprobs += lp.token_logprobs
        alternatives += [dict(d) for d in lp.top_logprobs]
    return Answer(text, tokens, logprobs, alternatives)


def chat_logprob_answer(parts):
    """Answer from (content, logprobs.content) pairs of a chat answer or its stream chunks."""
    text, tokens, logprobs, alternatives = "", [], [], []
    for content, entries in parts:
        text += content or ""
        for e in entries or []:
            tokens.append(e.token)
            logprobs.append(e.logprob)
            alt = {}
            for x in e.top_logprobs:
                alt[x.token] = max(alt.get(x.token, -1e30), x.logprob)
            alternatives.append(alt)
    return Answer(text, tokens, logprobs, alternatives)


def ask_greedy(client, model, kind, prompt_index, stream):
    """A greedy answer to PROMPTS[prompt_index] (kind "completion") or CHAT (kind "chat"); with
    log-probabilities when the run compares near-ties."""
    with_logprobs = ARGS.compare == "near-tie"
    if kind == "completion":
        extra = {"logprobs": TOP_ALTERNATIVES} if with_logprobs else {}
        r = client.completions.create(model=model, prompt=PROMPTS[prompt_index],
                                      max_tokens=MAX_TOKENS, temperature=0, stream=stream, **extra)
        choices = [c.choices[0] for c in r if c.choices] if stream else [r.choices[0]]
        if with_logprobs:
            return completion_logprob_answer(choices)
        return Answer("".join(c.text for c in choices))
    extra = {"logprobs": True, "top_logprobs": TOP_ALTERNATIVES} if with_logprobs else {}
    r = client.chat.completions.create(model=model, messages=CHAT, max_tokens=MAX_TOKENS,
                                       temperature=0, stream=stream, **extra)
    if stream:
        parts = [(c.choices[0].delta.content,
                  c.choices[0].logprobs.content if c.choices[0].logprobs else None)
                 for c in r if c.choices]
    else:
        m = r.choices[0]
        parts = [(m.message.content, m.logprobs.content if m.logprobs else None)]
    if with_logprobs:
        return chat_logprob_answer(parts)
    return Answer("".join(p[0] or "" for p in parts))


def compare_answers(alone, got):
    """None when `got` (served in a batch) agrees with `alone` (served alone), else why not.
    Exact: the same text. Near-tie: the same tokens up to the first difference, and there the
    batched token is a top alternative of the alone run within NEAR_TIE_NATS of its best."""
    if ARGS.compare == "exact" or alone.tokens is None:
        return None if got.text == alone.text else f"{got.text!r} != alone {alone.text!r}"
    if got.tokens == alone.tokens:
        return None
    j = 0
    while j < min(len(got.tokens), len(alone.tokens)) and got.tokens[j] == alone.tokens[j]:
        j += 1
    if j == len(got.tokens) or j == len(alone.tokens):
        return f"{len(got.tokens)} tokens != alone {len(alone.tokens)} tokens"
    alt = alone.alternatives[j].get(got.tokens[j])
    if alt is None:
        return (f"token {j} {got.tokens[j]!r} is not among the alone run's top "
                f"{TOP_ALTERNATIVES} {sorted(alone.alternatives[j])}")
    if alone.logprobs[j] - alt > NEAR_TIE_NATS:
        return (f"token {j} {got.tokens[j]!r} is {alone.logprobs[j] - alt:.3f} nats below the "
                f"alone run's best {alone.tokens[j]!r} (near-tie bound {NEAR_TIE_NATS})")
    return None


def request_counts(server):
    """{(endpoint, adapter): count} of answered 200 requests from /metrics."""
    status, text = server.get("/metrics")
    assert status == 200, (status, text)
    counts = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "moelora_requests_total" and s.labels.get("status") == "200":
                key = (s.labels["endpoint"], s.labels["adapter"])
                counts[key] = counts.get(key, 0) + s.value
    return counts


def gauge(server, name):
    status, text = server.get("/metrics")
    assert status == 200, (status, text)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"metric {name} missing from /metrics:\n{text}")


class OpenAIClientTest(unittest.TestCase):
    """Request/response behaviour, one request at a time, on the shared server."""

    @classmethod
    def setUpClass(cls):
        cls.client = SERVER.client()

    def test_models_list(self):
        models = {m.id: m for m in self.client.models.list().data}
        self.assertIn(BASE, models)
        self.assertIsNone(getattr(models[BASE], "parent", None))
        for name in STABLE_ADAPTERS:
            self.assertIn(name, models)
            self.assertEqual(getattr(models[name], "parent", None), BASE)

    def test_completion_text_and_token_prompt(self):
        r = self.client.completions.create(model=BASE, prompt="The mixture of experts",
                                           max_tokens=MAX_TOKENS, temperature=0)
        self.assertEqual(len(r.choices), 1)
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, MAX_TOKENS)
        self.assertGreater(r.usage.prompt_tokens, 0)
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + MAX_TOKENS)
        r = self.client.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                           temperature=0)
        self.assertEqual(r.usage.prompt_tokens, len(PROMPTS[0]))
        self.assertEqual(r.usage.completion_tokens, MAX_TOKENS)
        # Greedy is deterministic, streamed or not.
        self.assertEqual(r.choices[0].text, greedy_completion(self.client, BASE, PROMPTS[0]))
        self.assertEqual(r.choices[0].text, greedy_completion_stream(self.client, BASE, PROMPTS[0]))

    def test_chat_completion_and_stream_with_usage(self):
        # ignore_eos: a random model may pick its end-of-text token early
        r = self.client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=MAX_TOKENS,
                                                temperature=0, extra_body={"ignore_eos": True})
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.choices[0].finish_reason, "length")
        self.assertEqual(r.usage.completion_tokens, MAX_TOKENS)
        answer = r.choices[0].message.content

        stream = self.client.chat.completions.create(
            model=BASE, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = list(stream)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(content, answer)
        finish = [c.choices[0].finish_reason for c in chunks
                  if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finish, ["length"])
        # include_usage: every chunk carries usage null except one final chunk with no choices.
        with_usage = [c for c in chunks if c.usage is not None]
        self.assertEqual(len(with_usage), 1)
        self.assertIs(with_usage[0], chunks[-1])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, MAX_TOKENS)
        self.assertEqual(chunks[-1].usage.prompt_tokens, r.usage.prompt_tokens)
        self.assertEqual(len({c.id for c in chunks}), 1)

    def test_adapter_selection_spellings(self):
        base = greedy_signature(self.client, BASE, PROMPTS[1])
        for name in STABLE_ADAPTERS:
            by_name = greedy_signature(self.client, name, PROMPTS[1])
            by_pair = greedy_signature(self.client, f"{BASE}:{name}", PROMPTS[1])
            by_body = greedy_signature(self.client, BASE, PROMPTS[1], {"lora_path": name})
            self.assertEqual(by_name, by_pair, name)
            self.assertEqual(by_name, by_body, name)
            self.assertNotEqual(by_name, base, f"adapter {name} answers like the base model")
        self.assertNotEqual(greedy_signature(self.client, STABLE_ADAPTERS[0], PROMPTS[1]),
                            greedy_signature(self.client, STABLE_ADAPTERS[1], PROMPTS[1]))

    def test_unknown_model_is_not_found(self):
        with self.assertRaises(openai.NotFoundError):
            self.client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
        with self.assertRaises(openai.NotFoundError):
            self.client.chat.completions.create(model=f"{BASE}:no-such-adapter", messages=CHAT,
                                                max_tokens=2)

    def test_bad_parameters_are_bad_requests(self):
        with self.assertRaises(openai.BadRequestError) as ctx:
            self.client.completions.create(model=BASE, prompt="x", max_tokens=2, temperature=7)
        self.assertIn("temperature", str(ctx.exception))
        self.assertEqual(ctx.exception.body.get("param"), "temperature")

    def test_logprobs(self):
        # One entry per generated token, each <= 0, with the asked number of alternatives.
        r = self.client.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=3,
                                           temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        self.assertIsNotNone(lp, "logprobs=2 but the choice has no logprobs")
        self.assertEqual(len(lp.tokens), 3)
        self.assertEqual(len(lp.token_logprobs), 3)
        self.assertTrue(all(x <= 0 for x in lp.token_logprobs), lp.token_logprobs)
        self.assertTrue(all(1 <= len(t) <= 2 for t in lp.top_logprobs), lp.top_logprobs)
        r = self.client.chat.completions.create(model=BASE, messages=CHAT, max_tokens=3,
                                                temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        self.assertIsNotNone(lp, "logprobs=true but the choice has no logprobs")
        self.assertEqual(len(lp.content), 3)
        for t in lp.content:
            self.assertEqual(len(t.top_logprobs), 2)
            # Greedy: the chosen token is the most likely one.
            self.assertAlmostEqual(t.logprob, t.top_logprobs[0].logprob, places=5)

    def test_seeded_sampling_is_reproducible(self):
        def sample():
            r = self.client.completions.create(model=BASE, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                               temperature=1.0, top_p=0.9, n=2, seed=1234)
            self.assertEqual(len(r.choices), 2)
            self.assertEqual(r.usage.completion_tokens, 2 * MAX_TOKENS)
            return [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        self.assertEqual(sample(), sample())

    def test_stop_strings_cut_the_text(self):
        full = greedy_completion(self.client, BASE, PROMPTS[3], max_tokens=24)
        # Pick a stop string from the middle of the greedy answer: the answer must end before it.
        stop = next((full[i:i + 2] for i in range(3, len(full) - 2)
                     if "\ufffd" not in full[i:i + 2] and full[i:i + 2].strip()), None)
        self.assertIsNotNone(stop, f"no usable stop string in {full!r}")
        r = self.client.completions.create(model=BASE, prompt=PROMPTS[3], max_tokens=24,
                                           temperature=0, stop=[stop])
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.choices[0].text, full[:full.index(stop)])

    def test_metrics_count_requests_per_adapter(self):
        before = request_counts(SERVER)
        sent = {}
        for model, label in [(BASE, "base")] + [(a, a) for a in STABLE_ADAPTERS]:
            for i in range(3):
                greedy_completion(self.client, model, PROMPTS[i], max_tokens=2)
            sent[("completions", label)] = 3
            self.client.chat.completions.create(model=model, messages=CHAT, max_tokens=2)
            sent[("chat_completions", label)] = 1
        after = request_counts(SERVER)
        for key, n in sent.items():
            self.assertEqual(after.get(key, 0) - before.get(key, 0), n, key)


class ApiKeyTest(unittest.TestCase):
    """A second server with --api-key: the API refuses clients without the key."""

    def test_api_key(self):
        server = Server(WORKDIR, "apikey", ["--api-key", "sesame"])
        try:
            with self.assertRaises(openai.AuthenticationError):
                server.client(api_key="wrong").completions.create(model=BASE, prompt="x",
                                                                  max_tokens=2)
            # No key at all: the client insists on one, so ask over plain HTTP.
            status, body = server.get("/v1/models")
            self.assertEqual(status, 401, body)
            ok = server.client(api_key="sesame")
            self.assertIn(BASE, [m.id for m in ok.models.list().data])
            r = ok.completions.create(model=BASE, prompt=PROMPTS[0], max_tokens=3, temperature=0)
            self.assertEqual(r.usage.completion_tokens, 3)
        finally:
            server.stop()


class CompareAnswersTest(unittest.TestCase):
    """compare_answers, the load test's judge, on made-up answers in both modes."""

    def setUp(self):
        self.mode = ARGS.compare

    def tearDown(self):
        ARGS.compare = self.mode

    def test_exact_needs_the_same_text(self):
        ARGS.compare = "exact"
        self.assertIsNone(compare_answers(Answer("a b"), Answer("a b")))
        self.assertIn("!= alone", compare_answers(Answer("a b"), Answer("a c")))

    def test_near_tie_allows_a_close_alternative_only(self):
        ARGS.compare = "near-tie"
        alone = Answer("xyz", ["x", "y", "z"], [-0.1, -0.6, -0.2],
                       [{"x": -0.1}, {"y": -0.6, "q": -0.7, "r": -2.0}, {"z": -0.2}])
        self.assertIsNone(compare_answers(alone, Answer("xyz", ["x", "y", "z"])))
        # Diverging at token 1 to an alternative 0.1 nats below the best: a near-tie.
        self.assertIsNone(compare_answers(alone, Answer("xqw", ["x", "q", "w"])))
        self.assertIn("nats below", compare_answers(alone, Answer("xrw", ["x", "r", "w"])))
        self.assertIn("not among", compare_answers(alone, Answer("xsw", ["x", "s", "w"])))
        self.assertIn("tokens != alone", compare_answers(alone, Answer("xy", ["x", "y"])))


class ServeLoadChurnTest(unittest.TestCase):
    """32 client threads on stable models while another thread loads and unloads an adapter."""

    THREADS = 64
    REQUESTS_PER_THREAD = 4

    def serial_answers(self, client, model):
        """{(kind, prompt index): Answer} answered one at a time."""
        out = {}
        for i in range(len(PROMPTS)):
            out[("completion", i)] = ask_greedy(client, model, "completion", i, stream=False)
        out[("chat", 0)] = ask_greedy(client, model, "chat", 0, stream=False)
        if ARGS.compare == "near-tie":
            for key, a in out.items():
                self.assertTrue(a.tokens, f"{model} {key}: no log-probabilities to compare")
                self.assertEqual(len(a.tokens), len(a.logprobs))
                self.assertEqual(len(a.tokens), len(a.alternatives))
        return out

    def load(self, name):
        return SERVER.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": "churn_dir"})

    def unload(self, name):
        return SERVER.post("/v1/unload_lora_adapter", {"lora_name": name})

    def test_load_and_adapter_churn(self):
        client = SERVER.client(timeout=120)
        stable = [BASE, *STABLE_ADAPTERS, f"{BASE}:{STABLE_ADAPTERS[0]}"]
        serial = {m: self.serial_answers(client, m) for m in stable}
        if ARGS.device == "cuda":
            # The GPU engine captures a decode graph per batch size bucket the first time a batch
            # of that size runs (host memory that stays): one burst as wide as the load first.
            with concurrent.futures.ThreadPoolExecutor(self.THREADS) as pool:
                list(pool.map(lambda t: greedy_completion(client, stable[t % len(stable)],
                                                          PROMPTS[t % len(PROMPTS)]),
                              range(self.THREADS)))
        # The server's resident memory once it has served every model once (its allocator pools
        # exist, and on the GPU its decode graphs): the load below must not leave it much higher.
        rss_idle = resident_bytes(SERVER.proc.pid)
        status, body = self.load(CHURN_ADAPTER)
        self.assertEqual(status, 200, body)
        serial[CHURN_ADAPTER] = self.serial_answers(client, CHURN_ADAPTER)
        status, body = self.unload(CHURN_ADAPTER)
        self.assertEqual(status, 200, body)
        self.assertNotEqual({k: a.text for k, a in serial[CHURN_ADAPTER].items()},
                            {k: a.text for k, a in serial[BASE].items()})

        def ask(model, key, stream):
            return ask_greedy(client, model, key[0], key[1], stream)

        keys = sorted(serial[BASE])
        problems = []  # (what, model, key, stream, detail)
        counts = {"ok": 0, "churn_ok": 0, "churn_404": 0, "identical": 0, "near_tie": 0}
        lock = threading.Lock()
        stop_churn = threading.Event()

        def worker(t):
            for j in range(self.REQUESTS_PER_THREAD):
                # Every fourth request goes to the churning adapter, the rest to the stable ones.
                churn = (t + j) % 4 == 0
                model = CHURN_ADAPTER if churn else stable[(t + j) % len(stable)]
                key = keys[(t * 7 + j) % len(keys)]
                stream = (t + j) % 2 == 1
                try:
                    text = ask(model, key, stream)
                except openai.NotFoundError as e:
                    with lock:
                        if churn:
                            counts["churn_404"] += 1
                        else:
                            problems.append(("404", model, key, stream, str(e)))
                    continue
                except Exception as e:  # noqa: BLE001 - any other error is a failure to report
                    with lock:
                        problems.append(("error", model, key, stream, repr(e)))
                    continue
                with lock:
                    why = compare_answers(serial[model][key], text)
                    if why is not None:
                        problems.append(("wrong answer", model, key, stream, why))
                    else:
                        counts["churn_ok" if churn else "ok"] += 1
                        counts["identical" if text.text == serial[model][key].text
                               else "near_tie"] += 1

        churn_log = {"loads": 0, "unloads": 0, "own_requests": 0}

        def churner():
            while not stop_churn.is_set():
                status, body = self.load(CHURN_ADAPTER)
                if status != 200:
                    # A deferred unload of the same name may still be draining: retry shortly.
                    if status == 400 and '"adapter_busy"' in body:
                        time.sleep(0.01)
                        continue
                    with lock:
                        problems.append(("load", CHURN_ADAPTER, None, None, f"{status} {body}"))
                    return
                churn_log["loads"] += 1
                # Between its own load and unload the adapter must answer correctly.
                key = keys[churn_log["loads"] % len(keys)]
                try:
                    text = ask(CHURN_ADAPTER, key, churn_log["loads"] % 2 == 0)
                    why = compare_answers(serial[CHURN_ADAPTER][key], text)
                    if why is not None:
                        with lock:
                            problems.append(("wrong answer (churner)", CHURN_ADAPTER, key, None,
                                             why))
                except Exception as e:  # noqa: BLE001
                    with lock:
                        problems.append(("error (churner)", CHURN_ADAPTER, key, None, repr(e)))
                churn_log["own_requests"] += 1
                status, body = self.unload(CHURN_ADAPTER)
                if status != 200:
                    with lock:
                        problems.append(("unload", CHURN_ADAPTER, None, None, f"{status} {body}"))
                    return
                churn_log["unloads"] += 1

        churn_thread = threading.Thread(target=churner)
        churn_thread.start()
        with concurrent.futures.ThreadPoolExecutor(self.THREADS) as pool:
            list(pool.map(worker, range(self.THREADS)))
        stop_churn.set()
        churn_thread.join(timeout=60)
        self.assertFalse(churn_thread.is_alive(), "churn thread hung")

        detail = "\n".join(map(str, problems[:20]))
        self.assertEqual(problems, [], f"{len(problems)} problems; first ones:\n{detail}")
        self.assertGreater(churn_log["loads"], 1, churn_log)
        stable_requests = sum(1 for t in range(self.THREADS)
                              for j in range(self.REQUESTS_PER_THREAD) if (t + j) % 4)
        self.assertEqual(counts["ok"], stable_requests)
        print(f"\nchurn: {churn_log}, requests: {counts}", file=sys.stderr)
        if ARGS.compare == "exact":
            self.assertEqual(counts["near_tie"], 0, counts)
        else:
            self.assertGreaterEqual(counts["identical"], counts["near_tie"], counts)

        status, _ = SERVER.get("/health")
        self.assertEqual(status, 200)
        # The running gauge is updated by the engine loop: give it a moment to settle.
        deadline = time.monotonic() + 10
        while gauge(SERVER, "moelora_requests_running") != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(gauge(SERVER, "moelora_requests_running"), 0)
        self.assertNotIn(CHURN_ADAPTER, [m.id for m in client.models.list().data])
        rss_after = resident_bytes(SERVER.proc.pid)
        print(f"server resident memory: {rss_idle / 2**20:.0f} MiB idle, "
              f"{rss_after / 2**20:.0f} MiB after the load", file=sys.stderr)
        if ARGS.sanitized:
            # ASan's quarantine holds freed memory resident; main() checks instead that the
            # server's exit, with LeakSanitizer's scan, is clean.
            return
        self.assertLessEqual(rss_after, rss_idle * 1.25 + 64 * 2**20,
                             "the server's memory did not return near its idle level")

    def test_sigterm_stops_the_server(self):
        server = Server(WORKDIR, "sigterm", [])
        server.proc.send_signal(signal.SIGTERM)
        self.assertEqual(server.proc.wait(timeout=20), 0, server.read_log())


def main():
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moelora", required=True, help="path of the moelora binary")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--preset", default="tiny-qwen3-moe",
                        help="`moelora synth` preset of the served model (a larger one such as "
                        "small-qwen3-moe for the GPU host's load test)")
    parser.add_argument("--all-experts", action="store_true",
                        help="route every token through all experts (see the module docstring)")
    parser.add_argument("--compare", choices=["exact", "near-tie"], default=None,
                        help="how the load test compares a batched answer with the answer alone "
                        "(default: exact on cpu, near-tie on cuda)")
    parser.add_argument("--sanitized", action="store_true",
                        help="the binary is built with AddressSanitizer: check leaks by every "
                        "server's clean exit instead of by its resident memory")
    ARGS, rest = parser.parse_known_args()
    ARGS.moelora = os.path.abspath(ARGS.moelora)
    if ARGS.compare is None:
        ARGS.compare = "near-tie" if ARGS.device == "cuda" else "exact"
    program = unittest.main(argv=[sys.argv[0], *rest], exit=False, verbosity=2)
    ok = program.result.wasSuccessful() and program.result.testsRun > 0
    failed_servers = []
    for s in Server.all_servers:
        code = s.stop()
        if ARGS.sanitized and code != 0:
            failed_servers.append(s)
            print(f"server '{s.name}' exited with {code} after SIGTERM, not 0: a sanitizer "
                  "report (such as a leak) is in its log below", file=sys.stderr)
    if not ok:
        failed_servers = Server.all_servers
    for s in failed_servers:
        print(f"\n===== server log '{s.name}' ({s.log_path}) =====", file=sys.stderr)
        print(s.read_log(), file=sys.stderr)
    if WORKDIR:
        shutil.rmtree(WORKDIR, ignore_errors=True)
    sys.exit(0 if ok and not failed_servers else 1)


if __name__ == "__main__":
    main()
