"""GenerateRequest's text and chat options through the real servers, each against a plain-torch reference computed
from the same model's logits (transformers' own logits processors where it has them): penalties, min_tokens,
logprobs, stop strings, chat templates and n; every bad value INVALID_ARGUMENT naming its field.
"""

import json
import shutil
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from conftest import load_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from exec_service.engine.sampler import counter_uniform
from protos import exec_pb2

MODEL = "tiny-chat"
EOS = 2
PROMPT = [5, 17, 300, 42, 9, 111, 64, 250, 7, 33, 480, 12]
# Its greedy output repeats a token at once (64, 64, ...): a penalty must count the token the previous step sampled,
# which is still on the device when the next step is prepared.
REPEATING = [71, 294, 436, 413, 394, 35, 133, 63]


@pytest.fixture(scope="module")
def chat_model(exec_stub, tiny_chat_dir):
    load_model(exec_stub, MODEL, weights=str(tiny_chat_dir))
    return MODEL


@pytest.fixture(scope="module")
def reference(tiny_chat_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_chat_dir, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_dir):
    return AutoTokenizer.from_pretrained(tiny_chat_dir)


def generate(stub, prompt=PROMPT, model=MODEL, **fields) -> dict[int, dict]:
    """Each sequence's tokens, text, logprobs and last message, by index."""
    if "messages" not in fields and "prompt" not in fields:
        fields["prompt_ids"] = prompt
    out = defaultdict(lambda: dict(tokens=[], text="", logprobs=[], last=None))
    for response in stub.Generate(exec_pb2.GenerateRequest(model=model, **fields)):
        seq = out[response.index]
        assert seq["last"] is None, "nothing follows a sequence's last message"
        assert len(response.logprobs) in (0, len(response.token_ids))
        seq["tokens"] += response.token_ids
        seq["text"] += response.text
        seq["logprobs"] += response.logprobs
        if response.finish_reason:
            seq["last"] = response
    return dict(out)


def reference_tokens(model, prompt: list[int], max_tokens: int, process=None, temperature: float = 0.0,
                     seed: int = 0, stop_ids=()) -> list[int]:
    """Token by token from full forwards: ``process(input_ids [1, L], logits [1, V]) -> logits``, then greedy, or
    Gumbel-max with the sampler's own counter noise for ``seed`` at the token's position."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[:, -1].float()
            if process is not None:
                logits = process(torch.tensor([ids]), logits)
            if temperature:
                noise = counter_uniform(torch.tensor([seed]), torch.tensor([len(ids)]), logits.shape[-1])
                logits = logits / temperature - noise.log().neg().log()
            ids.append(int(logits.argmax(-1)))
            if ids[-1] in stop_ids:
                break
    return ids[len(prompt):]


def openai_penalties(prompt_length: int, presence: float, frequency: float):
    def process(input_ids, logits):
        counts = torch.bincount(input_ids[0, prompt_length:], minlength=logits.shape[-1]).float()
        return logits - frequency * counts - presence * (counts > 0).float()
    return process


def test_repetition_penalty_is_transformers_own(exec_stub, chat_model, reference):
    for prompt in (PROMPT, REPEATING):
        plain = reference_tokens(reference, prompt, 20)
        expected = reference_tokens(reference, prompt, 20, RepetitionPenaltyLogitsProcessor(1.8))
        assert expected != plain, "the penalty should change this output"
        got = generate(exec_stub, prompt, max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.8)
        assert got[0]["tokens"] == expected
    # Sampled: the same penalty before the temperature and the noise.
    expected = reference_tokens(reference, PROMPT, 20, RepetitionPenaltyLogitsProcessor(1.8), temperature=0.7,
                                seed=99)
    got = generate(exec_stub, max_tokens=20, temperature=0.7, seed=99, ignore_eos=True, repetition_penalty=1.8)
    assert got[0]["tokens"] == expected


@pytest.mark.parametrize("prompt", [PROMPT, REPEATING])
def test_presence_and_frequency_penalties_count_the_output(exec_stub, chat_model, reference, prompt):
    for presence, frequency in ((1.5, 0.0), (0.0, 1.2), (-0.5, 2.0)):
        process = openai_penalties(len(prompt), presence, frequency)
        expected = reference_tokens(reference, prompt, 24, process)
        assert expected != reference_tokens(reference, prompt, 24)
        got = generate(exec_stub, prompt, max_tokens=24, temperature=0, ignore_eos=True, presence_penalty=presence,
                       frequency_penalty=frequency)
        assert got[0]["tokens"] == expected, (presence, frequency)


def test_penalised_and_plain_requests_share_steps_without_touching_each_other(exec_stub, chat_model, reference):
    """Rows without penalties are left as they are, and each penalised row counts its own tokens only."""
    prompts = [PROMPT, PROMPT[::-1], PROMPT[3:]]
    fields = [dict(repetition_penalty=1.5), {}, dict(presence_penalty=1.0, frequency_penalty=0.5)]
    processes = [RepetitionPenaltyLogitsProcessor(1.5), None, openai_penalties(len(prompts[2]), 1.0, 0.5)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(generate, exec_stub, prompt, max_tokens=16, temperature=0, ignore_eos=True, **f)
                   for prompt, f in zip(prompts, fields, strict=True)]
        results = [f.result()[0]["tokens"] for f in futures]
    for prompt, process, tokens in zip(prompts, processes, results, strict=True):
        assert tokens == reference_tokens(reference, prompt, 16, process)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached(exec_stub, chat_model, reference):
    first = reference_tokens(reference, PROMPT, 1)[0]
    stop = [first, EOS]
    # Without min_tokens, the first token stops it.
    assert generate(exec_stub, max_tokens=10, temperature=0, stop_token_ids=[first])[0]["tokens"] == [first]
    process = MinNewTokensLengthLogitsProcessor(len(PROMPT), 6, stop)
    expected = reference_tokens(reference, PROMPT, 10, process, stop_ids=stop)
    got = generate(exec_stub, max_tokens=10, temperature=0, stop_token_ids=[first], min_tokens=6)[0]
    assert got["tokens"] == expected and len(expected) >= 6 and first not in expected[:6]
    # Sampled, where the stop token is likely at every position.
    expected = reference_tokens(reference, PROMPT, 10, process, temperature=1.0, seed=3, stop_ids=stop)
    assert generate(exec_stub, max_tokens=10, temperature=1.0, seed=3, stop_token_ids=[first],
                    min_tokens=6)[0]["tokens"] == expected


def test_logprobs_are_the_raw_model_distribution(exec_stub, chat_model, reference, tokenizer):
    got = generate(exec_stub, max_tokens=12, temperature=0.9, seed=5, ignore_eos=True, logprobs=True,
                   top_logprobs=5, repetition_penalty=1.4)[0]
    tokens, logprobs = got["tokens"], got["logprobs"]
    assert len(logprobs) == len(tokens) == 12
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1].float().log_softmax(-1)
    for position, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
        row = expected[position]
        assert logprob.token_id == token and logprob.token == tokenizer.decode([token])
        assert logprob.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert [t.token_id for t in logprob.top] == row.topk(5).indices.tolist()
        assert [t.logprob for t in logprob.top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)
        assert [t.token for t in logprob.top] == [tokenizer.decode([t.token_id]) for t in logprob.top]
    # Without top_logprobs, the sampled token's only; without logprobs, none.
    assert all(not lp.top for lp in generate(exec_stub, max_tokens=3, logprobs=True)[0]["logprobs"])
    assert generate(exec_stub, max_tokens=3)[0]["logprobs"] == []


def test_stop_strings_end_the_text_across_token_boundaries(exec_stub, chat_model, tokenizer):
    full = generate(exec_stub, max_tokens=30, temperature=0, ignore_eos=True)[0]
    text, tokens = full["text"], full["tokens"]
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    # A stop string from the middle of the output that starts inside one token and ends inside a later one.
    offsets = [len(tokenizer.decode(tokens[:i + 1], skip_special_tokens=True)) for i in range(len(tokens))]
    start = next(o for o in offsets if o >= len(text) // 3) - 1
    stop = text[start:next(o for o in offsets if o > start + 3) + 1]
    found = text.find(stop)  # an output that repeats itself may have it earlier
    assert any(found < o < found + len(stop) for o in offsets), "the stop string should span tokens"
    got = generate(exec_stub, max_tokens=30, temperature=0, ignore_eos=True, stop=["zzzz-never", stop],
                   logprobs=True)[0]
    assert got["text"] == text[:found]
    ending = next(i for i, o in enumerate(offsets) if o >= found + len(stop))  # the token that completes the match
    assert got["tokens"] == tokens[:ending + 1] and len(got["logprobs"]) == ending + 1
    assert got["last"].finish_reason == exec_pb2.FINISH_REASON_STOP
    assert got["last"].usage.output_tokens == ending + 1
    # A stop string that never completes holds nothing back at the end.
    assert generate(exec_stub, max_tokens=30, temperature=0, ignore_eos=True,
                    stop=[text[-2:] + "\x00"])[0]["text"] == text


def test_chat_messages_render_with_the_models_template(exec_stub, chat_model, tokenizer):
    chat = [dict(role="system", content="a tiny model"), dict(role="user", content="the quick brown fox")]
    ids = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    by_chat = generate(exec_stub, messages=[exec_pb2.ChatMessage(**m) for m in chat], max_tokens=8, temperature=0,
                       ignore_eos=True)[0]
    by_ids = generate(exec_stub, ids, max_tokens=8, temperature=0, ignore_eos=True)[0]
    assert by_chat["tokens"] == by_ids["tokens"] and by_chat["last"].usage.prompt_tokens == len(ids)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the classic escape to os and subprocess
    "{{ messages.append(messages[0]) }}",  # the immutable sandbox: a template cannot change what it is given
])
def test_chat_templates_run_in_transformers_sandbox(tokenizer, template):
    """What exec_service/api/chat_prompt.py relies on, on whichever transformers runs the tests."""
    import jinja2.sandbox

    with pytest.raises(jinja2.sandbox.SecurityError):
        tokenizer.apply_chat_template([dict(role="user", content="hi")], chat_template=template, tokenize=False)


def test_chat_needs_a_template(exec_stub, chat_model, tiny_chat_dir, tmp_path):
    bare = tmp_path / "no-template"
    shutil.copytree(tiny_chat_dir, bare)
    config = json.loads((bare / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    load_model(exec_stub, "tiny-no-template", weights=str(bare))
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.Generate(exec_pb2.GenerateRequest(
            model="tiny-no-template", messages=[exec_pb2.ChatMessage(role="user", content="hi")])))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages: model 'tiny-no-template' has no chat template" in exc.value.details()
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-no-template"))


def test_n_sequences_each_with_its_seed_and_end(exec_stub, chat_model):
    def sampled(**fields):
        return generate(exec_stub, max_tokens=10, temperature=1.0, ignore_eos=True, **fields)

    alone = [sampled(seed=40 + i)[0]["tokens"] for i in range(3)]
    assert len({tuple(t) for t in alone}) == 3
    # n = 3 with seed 40 is seeds 40, 41, 42; again while other requests share its steps.
    with ThreadPoolExecutor(3) as pool:
        crowd = [pool.submit(sampled, prompt=PROMPT[i:], seed=i, n=2) for i in range(2)]
        together = sampled(seed=40, n=3, logprobs=True)
        [f.result() for f in crowd]
    assert sorted(together) == [0, 1, 2]
    for index, seq in together.items():
        assert seq["tokens"] == alone[index]
        assert len(seq["logprobs"]) == 10
        last = seq["last"]
        assert last.finish_reason == exec_pb2.FINISH_REASON_LENGTH and last.index == index
        assert last.usage.output_tokens == 10 and last.usage.prompt_tokens == len(PROMPT)
    # Each sequence ends on its own: a stop token one of them samples ends only that one.
    stop = alone[1][4]
    ended = sampled(seed=40, n=3, stop_token_ids=[stop])
    for index, seq in ended.items():
        cut = alone[index].index(stop) + 1 if stop in alone[index] else 10
        assert seq["tokens"] == alone[index][:cut]
        assert seq["last"].finish_reason == (exec_pb2.FINISH_REASON_STOP if stop in alone[index]
                                             else exec_pb2.FINISH_REASON_LENGTH)


def test_n_sequences_after_the_first_prefill_once_its_prompt_is_computed(exec_stub, chat_model, step_records):
    """The n-1 others are scheduled once the first's first token is read: with prefix caching, its prompt's KV
    blocks are in the cache by then, for them to reuse."""
    before = len(step_records)
    got = generate(exec_stub, max_tokens=4, temperature=1.0, seed=1, ignore_eos=True, n=3)
    assert sorted(got) == [0, 1, 2]
    records = step_records[before:]
    assert len(records[0].request_ids) == 1
    assert records[0].phase == "prefill" and records[0].num_tokens == len(PROMPT)
    # On the CPU a step is read before the next is scheduled (it is done once launched): the others come in the
    # step right after the first's prefill, beside its first decode.
    assert records[1].batch_size == 3 and records[1].phase == "mixed"
    assert records[1].num_tokens == 1 + 2 * len(PROMPT)


def test_n_with_stop_strings_ends_each_sequence_on_its_own(exec_stub, chat_model, tokenizer):
    outputs = generate(exec_stub, max_tokens=16, temperature=1.0, seed=8, ignore_eos=True, n=2)
    stop = outputs[0]["text"][len(outputs[0]["text"]) // 2:][:3]
    got = generate(exec_stub, max_tokens=16, temperature=1.0, seed=8, ignore_eos=True, n=2, stop=[stop])
    for index in (0, 1):
        text = outputs[index]["text"]
        expected = text[:text.find(stop)] if stop in text else text
        assert got[index]["text"] == expected
    assert got[0]["last"].finish_reason == exec_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize("fields, message", [
    (dict(top_logprobs=21, logprobs=True), "top_logprobs: 21 is outside [0, 20]"),
    (dict(top_logprobs=-1, logprobs=True), "top_logprobs: -1"),
    (dict(top_logprobs=3), "top_logprobs: needs logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty: 2.5 is outside [-2, 2]"),
    (dict(presence_penalty=float("nan")), "presence_penalty: nan"),
    (dict(frequency_penalty=-2.1), "frequency_penalty: -2.1 is outside [-2, 2]"),
    (dict(repetition_penalty=0.0), "repetition_penalty: 0.0 is outside (0, 10]"),
    (dict(repetition_penalty=-1.0), "repetition_penalty: -1.0"),
    (dict(repetition_penalty=11.0), "repetition_penalty: 11.0"),
    (dict(min_tokens=17), "min_tokens: 17 is outside [0, max_tokens 16]"),
    (dict(min_tokens=-1), "min_tokens: -1"),
    (dict(n=-1), "n: -1 is outside [0, 64]"),
    (dict(n=65), "n: 65"),
    (dict(stop=[""]), "stop[0]: '' must be 1 to 128 characters"),
    (dict(stop=["x" * 129]), "stop[0]"),
    (dict(stop=[f"s{i}" for i in range(17)]), "stop: 17 strings, more than 16"),
    (dict(messages=[exec_pb2.ChatMessage(role="wizard", content="hi")]), "messages[0].role: 'wizard'"),
    (dict(messages=[exec_pb2.ChatMessage(role="assistant", content="hi")]),
     "messages: the chat template of 'tiny-chat' refused them: 'a chat opens with system or user'"),
    (dict(messages=[exec_pb2.ChatMessage(role="user", content="x" * 40000)]), "messages: 40000 characters"),
    (dict(messages=[exec_pb2.ChatMessage(role="user", content="hi")] * 1025), "messages: 1025 messages"),
    # 16,000 characters of content, under the 32 a token of max_model_len 512 allows; the template's own text is not.
    (dict(messages=[exec_pb2.ChatMessage(role="user", content="x" * 16)] * 1000), "messages: the rendered chat is"),
    (dict(messages=[exec_pb2.ChatMessage(role="user", content="hi")], prompt="hello"),
     "prompt: set exactly one of prompt, prompt_ids and messages, not prompt and messages"),
])
def test_bad_values_are_invalid_argument_naming_the_field(exec_stub, chat_model, fields, message):
    fields = {"prompt": "the quick brown fox", **fields} if "messages" not in fields else fields
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.Generate(exec_pb2.GenerateRequest(model=MODEL, **fields)))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in exc.value.details()


@pytest.mark.parametrize("fields, message", [
    (dict(stop=["x"]), "stop: model 'tiny' has no tokenizer"),
    (dict(messages=[exec_pb2.ChatMessage(role="user", content="hi")], prompt_ids=[]),
     "messages: model 'tiny' has no tokenizer"),
])
def test_text_options_need_a_tokenizer(exec_stub, tiny_loaded, fields, message):
    fields = {"prompt_ids": [1, 2, 3], **fields} if "messages" not in fields else fields
    with pytest.raises(grpc.RpcError) as exc:
        list(exec_stub.Generate(exec_pb2.GenerateRequest(model="tiny", **fields)))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in exc.value.details()


def test_kiln_generate_sends_every_option(exec_server, exec_stub, chat_model, capsys):
    from kiln_cli import main

    common = ["generate", exec_server.address, "--model", MODEL, "--max-tokens", "6", "--temperature", "1",
              "--seed", "3", "--ignore-eos"]
    chat = [exec_pb2.ChatMessage(role="system", content="be brief"), exec_pb2.ChatMessage(role="user", content="hi")]
    expected = generate(exec_stub, messages=chat, max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, n=2,
                        logprobs=True, top_logprobs=2, presence_penalty=0.5, frequency_penalty=0.25,
                        repetition_penalty=1.2, min_tokens=2)
    assert main([*common, "--message", "system=be brief", "--message", "user=hi", "--n", "2", "--logprobs",
                 "--top-logprobs", "2", "--presence-penalty", "0.5", "--frequency-penalty", "0.25",
                 "--repetition-penalty", "1.2", "--min-tokens", "2", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for index in (0, 1):
        mine = [line for line in lines if line.get("index", 0) == index]
        assert [t for line in mine for t in line.get("token_ids", [])] == expected[index]["tokens"]
        assert sum(len(line.get("logprobs", [])) for line in mine) == 6

    # For a person: each sequence whole under its index, a line per token's logprob, a usage line each.
    assert main([*common, "--chat", "hi", "--n", "2", "--logprobs", "--stop", "zz"]) == 0
    out = capsys.readouterr().out
    assert out.count("[length] ") == 2 and "[0] " in out and "[1] " in out
    assert sum(line.startswith("  ") for line in out.splitlines()) == 12
    with pytest.raises(SystemExit):
        main([*common, "--message", "nonsense"])
    assert "ROLE=CONTENT" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_penalties_min_tokens_and_logprobs_in_cuda_graph_steps(gpu_stub):
    """On CUDA, in CUDA-graph decode steps, with the penalties' pairs and the logprobs copied through pinned memory
    while the step before runs: the tokens of four requests sharing steps, each with other options, against
    transformers' float32 model on the device."""
    from kiln.model.causal_lm import transformers_model
    from kiln.model.spec import resolve
    from protos import common_pb2

    spec = common_pb2.ModelSpec(preset="tiny-llama", dtype="float32")
    config = common_pb2.CompileConfig(device="cuda", max_num_batched_tokens=128)
    events = list(gpu_stub.LoadModel(exec_pb2.LoadModelRequest(
        name="tiny-gpu-sampling", model=spec, config=config, runtime_mode=exec_pb2.RUNTIME_MODE_CUDAGRAPH,
        capture_sizes=[1, 2, 4, 8], kv_cache_bytes=64 << 20)))
    assert events[-1].ready.runtime_mode == "cudagraph"
    model = transformers_model(resolve(spec, "cuda"), "cuda", seed=0)
    model.config._attn_implementation = "sdpa"

    def reference(prompt, process, stop_ids=()):
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(16):
                input_ids = torch.tensor([ids], device="cuda")
                logits = model(input_ids).logits[:, -1].float()
                ids.append(int((process(input_ids, logits) if process else logits).argmax(-1)))
                if ids[-1] in stop_ids:
                    break
        return ids[len(prompt):]

    first = reference(REPEATING, None)[0]
    cases = [
        (REPEATING, dict(repetition_penalty=1.8), RepetitionPenaltyLogitsProcessor(1.8), ()),
        (PROMPT, dict(presence_penalty=1.5, frequency_penalty=0.5), openai_penalties(len(PROMPT), 1.5, 0.5), ()),
        (REPEATING, dict(min_tokens=6, stop_token_ids=[first]),
         MinNewTokensLengthLogitsProcessor(len(REPEATING), 6, [first, EOS], device="cuda"), (first,)),
        (PROMPT[::-1], dict(logprobs=True, top_logprobs=3), None, ()),
    ]

    def run(case):
        prompt, fields, _, _ = case
        responses = list(gpu_stub.Generate(exec_pb2.GenerateRequest(
            model="tiny-gpu-sampling", prompt_ids=prompt, max_tokens=16, temperature=0,
            ignore_eos="min_tokens" not in fields, **fields)))
        return [t for r in responses for t in r.token_ids], [lp for r in responses for lp in r.logprobs]

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for (prompt, fields, process, stop_ids), (tokens, _) in zip(cases, results, strict=True):
        assert tokens == reference(prompt, process, stop_ids), fields
    tokens, logprobs = results[-1]
    with torch.no_grad():
        prompt = cases[-1][0]
        expected = model(torch.tensor([prompt + tokens], device="cuda")).logits[0, len(prompt) - 1:-1].float()
    expected = expected.log_softmax(-1).cpu()
    assert [lp.logprob for lp in logprobs] == pytest.approx(
        [expected[i, t].item() for i, t in enumerate(tokens)], abs=1e-3)
    assert [[t.token_id for t in lp.top] for lp in logprobs] == expected.topk(3).indices.tolist()


def test_a_stream_interval_streams_the_same_sequences_in_fewer_messages(exec_stub, chat_model, tiny_chat_dir,
                                                                         tokenizer):
    """stream_interval 3 on the same weights: two sampled sequences of one prompt, with logprobs and a stop string
    that matches, come out as the default interval streams them (tokens, text, logprobs, how they end), in fewer
    messages, each message with one logprob per token."""
    load_model(exec_stub, "tiny-chat-paced", weights=str(tiny_chat_dir), stream_interval=3)
    fields = dict(max_tokens=14, temperature=1.0, seed=11, n=2, logprobs=True, top_logprobs=2, ignore_eos=True)
    unstopped = generate(exec_stub, **fields)[0]["text"]
    stop = unstopped[len(unstopped) // 2:][:2]  # text from the middle of the first sequence: it ends there
    each, paced = (generate(exec_stub, model=m, stop=[stop], **fields) for m in (MODEL, "tiny-chat-paced"))
    assert sorted(paced) == sorted(each) == [0, 1] and each[0]["last"].finish_reason == exec_pb2.FINISH_REASON_STOP
    for index in each:
        assert (paced[index]["tokens"], paced[index]["text"]) == (each[index]["tokens"], each[index]["text"]), index
        # Logprob values to float rounding: the paced run's steps held the stopped sequence up to two steps more.
        def ids(run, index=index):
            return [(lp.token_id, [t.token_id for t in lp.top]) for lp in run[index]["logprobs"]]

        def values(run, index=index):
            return [v for lp in run[index]["logprobs"] for v in (lp.logprob, *(t.logprob for t in lp.top))]

        assert ids(paced) == ids(each) and values(paced) == pytest.approx(values(each), abs=1e-5)
        assert paced[index]["last"].finish_reason == each[index]["last"].finish_reason
        assert paced[index]["last"].usage.output_tokens == each[index]["last"].usage.output_tokens

    def messages(model: str) -> int:
        request = exec_pb2.GenerateRequest(model=model, prompt_ids=PROMPT, max_tokens=10, ignore_eos=True)
        return len(list(exec_stub.Generate(request)))

    assert (messages(MODEL), messages("tiny-chat-paced")) == (10, 4)  # 1 + 3 + 3 + 3
    exec_stub.UnloadModel(exec_pb2.UnloadModelRequest(name="tiny-chat-paced"))
