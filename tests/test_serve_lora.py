"""`hf-paged serve BASE --lora name=path`: the real server in a subprocess serving a tiny model and its LoRA
adapters, spoken to with the `openai` client: `/v1/models` lists them, the `model` field picks one (each reply equals
PEFT's `generate` with only that adapter), runtime load/unload behind the API key, per-model counters."""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged.reference_models import random_lora

from .lora_helpers import ALL_LINEAR, PeftReference, save_lora
from .serve_helpers import API_KEY, TINY, ServerProcess, metric, save_tiny_model, wait_for_idle

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = save_tiny_model(tmp_path_factory.mktemp("tiny-model"))
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    adapters = {
        "qv": random_lora(base, seed=1, rank=4),
        "all": random_lora(base, seed=2, rank=8, target_modules=ALL_LINEAR),
        "late": random_lora(base, seed=3, rank=2, target_modules=("o_proj",)),
    }
    paths = {name: save_lora(adapter, tmp_path_factory.mktemp(name)) for name, adapter in adapters.items()}
    options = ["--served-model-name", TINY, "--num-blocks", "128", "--block-size", "16", "--api-key", API_KEY]
    for name in ("qv", "all"):
        options += ["--lora", f"{name}={paths[name]}"]
    process = ServerProcess(folder, *options, "--max-loras", "3", "--exact")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    yield process.base, paths, PeftReference(base, adapters), tokenizer
    process.close()


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=f"{setup[0]}/v1", api_key=API_KEY, max_retries=0)


def expected_text(reference: PeftReference, tokenizer, prompt: str, adapter: str | None, max_tokens: int) -> str:
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    tokens = reference.generate(ids, adapter, max_tokens, min_new_tokens=0)
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_models_lists_the_base_and_each_adapter_with_its_parent(setup, client):
    _, paths, _, _ = setup
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == [TINY, "qv", "all"]
    assert models[TINY].parent is None
    assert (models["qv"].parent, models["qv"].root) == (TINY, paths["qv"])


def test_the_model_field_selects_the_adapter(setup, client):
    _, _, reference, tokenizer = setup
    prompt = "The weather today is"
    texts = {}
    for model in (TINY, "qv", "all"):
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
        assert reply.model == model
        name = None if model == TINY else model
        assert reply.choices[0].text == expected_text(reference, tokenizer, prompt, name, 8)
        texts[model] = reply.choices[0].text
    assert len(set(texts.values())) == 3  # the adapters change the answer
    chat = client.chat.completions.create(
        model="all", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    assert chat.model == "all" and chat.choices[0].message.content is not None


def test_an_unknown_model_is_a_404_in_openai_format(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    body = error.value.body
    assert body["code"] == "model_not_found" and body["param"] == "model"
    assert "'nope' does not exist; this server serves ['tiny', 'qv', 'all']" in body["message"]


def test_adapters_load_and_unload_at_runtime_behind_the_api_key(setup, client):
    server, paths, reference, tokenizer = setup
    load = {"lora_name": "late", "lora_path": paths["late"]}
    assert httpx.post(f"{server}/v1/load_lora_adapter", json=load).status_code == 401
    headers = {"Authorization": f"Bearer {API_KEY}"}
    reply = httpx.post(f"{server}/v1/load_lora_adapter", json=load, headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    assert [m.id for m in client.models.list().data] == [TINY, "qv", "all", "late"]
    text = client.completions.create(model="late", prompt="Once", max_tokens=6, temperature=0).choices[0].text
    assert text == expected_text(reference, tokenizer, "Once", "late", 6)
    again = httpx.post(f"{server}/v1/load_lora_adapter", json=load, headers=headers)
    assert again.status_code == 400 and "loaded already" in again.json()["error"]["message"]
    too_many = httpx.post(
        f"{server}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": paths["qv"]}, headers=headers
    )
    assert too_many.status_code == 400 and "max_adapters=3" in too_many.json()["error"]["message"]
    bad_path = httpx.post(
        f"{server}/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": "/no/such/dir"}, headers=headers
    )
    assert bad_path.status_code == 400 and "no PEFT adapter directory" in bad_path.json()["error"]["message"]
    unload = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=headers)
    assert unload.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="Once", max_tokens=2)
    gone = httpx.post(f"{server}/v1/unload_lora_adapter", json={"lora_name": "late"}, headers=headers)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_metrics_count_requests_and_tokens_per_model(setup, client):
    server = setup[0]
    wait_for_idle(server)
    before = metric(server, 'hf_paged_requests_by_model_total{model="qv"}')
    client.completions.create(model="qv", prompt="Count me", max_tokens=3, temperature=0, extra_body={"min_tokens": 3})
    wait_for_idle(server)
    assert metric(server, 'hf_paged_requests_by_model_total{model="qv"}') == before + 1
    assert metric(server, 'hf_paged_generation_tokens_by_model_total{model="qv"}') >= 3
    assert metric(server, f'hf_paged_requests_by_model_total{{model="{TINY}"}}') >= 1
    assert metric(server, "hf_paged_lora_adapters_loaded") == 2
    assert metric(server, "hf_paged_lora_adapter_bytes") > 0
