"""Tiers behind the prefix cache (`hf_paged.offload`): exact reloads, isolation, corrupt entries, budgets, faults, and
a real Redis server."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import get_pool, release_pool
from hf_paged.offload import CorruptBlockError, DirectoryStore, KVOffload, MemoryStore, OffloadConfig, RedisStore
from hf_paged.offload.codec import decode, encode
from hf_paged.prefix import chain
from hf_paged.reference_models import tiny_model

from .redis_helpers import free_port, redis_server

BLOCK = 8


def _prompt(length: int = 100, seed: int = 0, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (batch, length), generator=generator)


def _generate(model, ids, tiers: dict, **options):
    cache_config = {"block_size": BLOCK, "num_blocks": 96, "kv_offload": tiers, **options.pop("cache_config", {})}
    options = {"max_new_tokens": 8, "do_sample": False, **options}
    return model.generate(ids, cache_implementation="paged", cache_config=cache_config, **options)


def _loaded(model) -> int:
    return get_pool(model).offload.stats().tokens_loaded


def _blocks_by_key(model) -> dict[bytes, dict[str, torch.Tensor]]:
    """Every cached block of the model's pool, as stored, by its persistent key."""
    pool = get_pool(model)
    links = pool.offload._links
    out = {}
    for block_id, ours in list(pool.allocator._block_hash.items()):
        if ours in links:
            out[links[ours]] = {k: v[0] for k, v in pool.storage.blocks_tensors([block_id]).items()}
    return out


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def _fresh(family: str = "llama", seed: int = 0, **overrides):
    """A new model with the same weights as an earlier one of the same seed: a restarted process's."""
    return tiny_model(family, seed=seed, **overrides).eval()


# ---------------------------------------------------------------------------- exact reloads
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int4", "int4-channel"])
def test_reload_from_disk_is_bit_exact_and_gives_the_same_tokens(tmp_path, kv_dtype):
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(100)
    first = _fresh()
    out_first = _generate(first, ids, tiers, cache_config={"kv_dtype": kv_dtype})
    get_pool(first).offload.flush()
    written = _blocks_by_key(first)
    assert get_pool(first).offload.stats().tiers[0].writes == len(list(tmp_path.rglob("*.safetensors"))) >= 12

    second = _fresh()
    out_second = _generate(second, ids, tiers, cache_config={"kv_dtype": kv_dtype})
    assert _loaded(second) == 96  # 12 full blocks of the 100-token prompt (the last token is computed)
    assert get_pool(second).stats().prefix_tokens_reused >= 96
    assert torch.equal(out_first, out_second)
    loaded = _blocks_by_key(second)
    # the 12 blocks loaded; the 13th (tokens 96-103) each process computed, in other matmul shapes (a 100-token
    # prefill, a 4-token one after the loaded prefix), which may round differently on some CPUs
    (persistent_root,) = set(get_pool(second).offload._roots.values())
    prompt_keys = {key for key, _ in chain(persistent_root, ids[0, :96].tolist(), BLOCK)}
    common = set(written) & set(loaded) & prompt_keys
    assert len(common) == 12
    assert all(_bits_equal(written[key], loaded[key]) for key in common)
    if kv_dtype == "auto":
        reference = second.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=DynamicCache())
        assert torch.equal(out_second, reference)
    get_pool(second).check_invariants()


def test_beams_and_several_sequences_over_a_reloaded_prefix(tmp_path):
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(90, seed=3)
    _generate(_fresh(), ids, tiers)
    for options in ({"num_beams": 3, "num_return_sequences": 2}, {"num_beams": 2, "early_stopping": True}):
        model = _fresh()
        paged = _generate(model, ids, tiers, **options)
        assert _loaded(model) == 88
        release_pool(model)
        reference = model.generate(ids, max_new_tokens=8, do_sample=False, **options)
        assert torch.equal(paged, reference)


def test_sampled_sequences_over_a_reloaded_prefix(tmp_path):
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(70, seed=4)
    _generate(_fresh(), ids, tiers)
    model = _fresh()
    torch.manual_seed(7)
    paged = _generate(model, ids, tiers, do_sample=True, num_return_sequences=3)
    assert _loaded(model) == 64
    torch.manual_seed(7)
    reference = model.generate(ids, max_new_tokens=8, do_sample=True, num_return_sequences=3)
    assert torch.equal(paged, reference)


@pytest.mark.parametrize("family", ["gemma3", "starcoder2"])
def test_sliding_window_groups_reload(tmp_path, family):
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(60, seed=5)
    _generate(_fresh(family), ids, tiers)
    model = _fresh(family)
    paged = _generate(model, ids, tiers)
    assert _loaded(model) > 0
    reference_cache = DynamicCache(config=model.config)
    reference = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=reference_cache)
    assert torch.equal(paged, reference)


def test_engine_reloads_and_reports_its_tiers(tmp_path):
    tiers = {"dir": str(tmp_path)}
    prompt = _prompt(80, seed=6)[0].tolist()
    with hf_paged.Engine(_fresh(), block_size=BLOCK, num_blocks=64, exact=True, kv_offload=tiers) as engine:
        first = engine.generate([prompt], max_new_tokens=6)[0].token_ids
        engine.pool.offload.flush()
        assert engine.stats().kv_tiers[0].writes >= 10
    model = _fresh()
    with hf_paged.Engine(model, block_size=BLOCK, num_blocks=64, exact=True, kv_offload=tiers) as engine:
        second = engine.generate([prompt], max_new_tokens=6)[0].token_ids
        (disk,) = engine.stats().kv_tiers
        assert (disk.name, disk.hits, disk.tokens_loaded, disk.rejects) == ("disk", 9, 72, 0)
        assert engine.stats().prefix_hit_rate > 0.85
        picture = hf_paged.render_pool_text(engine.pool).splitlines()
        assert picture[1] == f"KV tiers: directory {tmp_path} (10.0 GiB)"
    assert first == second


def test_engine_adapter_requests_reload_their_own_blocks(tmp_path):
    """An Engine's LoRA requests keep their blocks in the tiers under their adapter's name and weights digest: a new
    process serving the same adapter loads them and answers alike; the base model and another adapter load none."""
    from hf_paged.reference_models import random_lora

    tiers = {"dir": str(tmp_path)}
    prompt = _prompt(80, seed=13)[0].tolist()
    options = {"block_size": BLOCK, "num_blocks": 64, "exact": True, "kv_offload": tiers}

    def serve(adapter: str | None):
        model = _fresh()
        adapters = {"a": random_lora(model, seed=1), "b": random_lora(model, seed=2)}
        with hf_paged.Engine(model, adapters=adapters, **options) as engine:
            tokens = engine.generate([prompt], max_new_tokens=6, adapter=adapter)[0].token_ids
            engine.pool.offload.flush()
            return tokens, engine.stats().kv_tiers[0]

    first, written = serve("a")
    assert written.writes >= 10 and written.tokens_loaded == 0
    again, disk = serve("a")
    assert again == first and disk.tokens_loaded == 72
    for other in (None, "b"):  # negative controls: other K/V for the same tokens
        tokens, disk = serve(other)
        assert disk.tokens_loaded == 0 and tokens != first


# ---------------------------------------------------------------------------- isolation
@pytest.mark.parametrize(
    "other",
    [
        pytest.param(lambda: _fresh(seed=1), id="other-weights"),
        pytest.param(lambda: _fresh().to(torch.bfloat16), id="other-dtype"),
        pytest.param(lambda: _fresh(num_hidden_layers=3), id="other-config"),
        pytest.param("int8", id="other-page-format"),
        pytest.param("lora", id="adapter"),
        pytest.param("block", id="other-block-size"),
    ],
)
def test_other_models_never_read_each_others_blocks(tmp_path, other):
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(64, seed=8)
    _generate(_fresh(), ids, tiers)
    options = {}
    if other == "int8":
        model, options = _fresh(), {"kv_dtype": "int8"}
    elif other == "block":
        model, options = _fresh(), {"block_size": 4}
    elif other == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(_fresh(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        model.eval()
    else:
        model = other()
    _generate(model, ids, tiers, cache_config=options)
    assert _loaded(model) == 0
    pool = get_pool(model)
    assert pool.offload.stats().tiers[0].rejects == 0
    control = _fresh()  # negative control: the same model does load them
    _generate(control, ids, tiers)
    assert _loaded(control) == 56


def test_a_model_edited_in_place_stops_loading_what_it_wrote_before(tmp_path):
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(64, seed=9)
    model = _fresh()
    _generate(model, ids, tiers)
    release_pool(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0  # one element: the digest of every weight sees it
    _generate(model, ids, tiers)
    assert _loaded(model) == 0


# ---------------------------------------------------------------------------- corrupt entries
@pytest.mark.parametrize("damage", ["flip", "truncate", "other-key", "empty"])
def test_damaged_entries_are_misses_never_served(tmp_path, damage):
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(64, seed=10)
    _generate(_fresh(), ids, tiers)
    files = sorted(tmp_path.rglob("*.safetensors"), key=os.path.getmtime)
    assert len(files) == 8
    victim = files[3]  # the chain's fourth block: blocks after it cannot be used either
    data = victim.read_bytes()
    if damage == "flip":
        data = data[:-100] + bytes([data[-100] ^ 1]) + data[-99:]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "other-key":
        data = files[4].read_bytes()
    else:
        data = b""
    victim.write_bytes(data)
    model = _fresh()
    paged = _generate(model, ids, tiers)
    (disk,) = get_pool(model).offload.stats().tiers
    assert disk.rejects == 1
    assert disk.tokens_loaded == 3 * BLOCK
    assert victim.exists() and victim.read_bytes() != data  # deleted, then written again from the recomputed K/V
    release_pool(model)
    assert torch.equal(paged, model.generate(ids, max_new_tokens=8, do_sample=False))


def test_codec_refuses_what_it_did_not_write():
    data = encode("aa", {"k.0": torch.arange(6.0).view(2, 3)})
    assert torch.equal(decode("aa", data)["k.0"], torch.arange(6.0).view(2, 3))
    for bad in (data[:-1], data[:10], b"x" * 40, data[:30] + bytes([data[30] ^ 4]) + data[31:]):
        with pytest.raises(CorruptBlockError):
            decode("aa", bad)
    with pytest.raises(CorruptBlockError, match="holds block aa"):
        decode("bb", data)


# ---------------------------------------------------------------------------- budgets and stores
def test_directory_budget_drops_the_least_recently_used(tmp_path):
    store = DirectoryStore(str(tmp_path), max_bytes=1000)
    for index in range(4):
        assert store.put(f"{index:04x}", bytes(300))
        time.sleep(0.01)
    assert store.get("0001") is not None  # used: now the most recent
    store.put("0004", bytes(300))
    assert store.nbytes() <= 1000
    kept = sorted(p.stem for p in tmp_path.rglob("*.safetensors"))
    assert "0001" in kept and "0000" not in kept and "0004" in kept
    assert store.evictions >= 2
    assert not store.put("00ff", bytes(2000))  # larger than the whole budget: not kept
    again = DirectoryStore(str(tmp_path), max_bytes=1000)  # a new process reads what is there
    assert again.entries() == len(kept) and again.nbytes() == 300 * len(kept)


def test_memory_store_budget():
    store = MemoryStore(max_bytes=100)
    for index in range(5):
        store.put(str(index), bytes(40))
    assert store.entries() == 2 and store.nbytes() == 80 and store.evictions == 3
    assert store.get("4") is not None and store.get("0") is None


def test_disk_budget_holds_while_generating(tmp_path):
    block_bytes = len(encode("0" * 32, _blocks_by_key_one_block()))
    tiers = {"dir": str(tmp_path), "disk_bytes": 5 * block_bytes}
    model = _fresh()
    for seed in range(4):
        _generate(model, _prompt(64, seed=20 + seed), tiers)
    offload = get_pool(model).offload
    offload.flush()
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert total <= 5 * block_bytes
    assert offload.stats().tiers[0].evictions > 0


def _blocks_by_key_one_block() -> dict[str, torch.Tensor]:
    """What one block of the tiny llama (2 layers, 2 KV heads of 16) weighs as stored, to size a budget in blocks."""
    return {f"{p}.{lane}": torch.zeros(BLOCK, 2, 16) for p in ("k", "v") for lane in range(2)}


def test_host_tier_serves_before_the_disk(tmp_path):
    tiers = {"dir": str(tmp_path), "host_bytes": "64MiB"}
    ids = _prompt(64, seed=11)
    first = _fresh()
    _generate(first, ids, tiers)
    offload = get_pool(first).offload
    offload.flush()
    release_pool(first)  # the pool's blocks are gone; the host tier still holds them
    again = _fresh()
    # the same process: hand the first pool's tiers over, as a pool rebuilt for a new size keeps them
    get_pool(again, block_size=BLOCK, num_blocks=96).offload = offload
    _generate(again, ids, tiers={"dir": str(tmp_path), "host_bytes": "64MiB"})
    host, disk = get_pool(again).offload.stats().tiers
    assert host.tokens_loaded == 56 and disk.tokens_loaded == 0


def test_a_hit_in_a_lower_tier_is_promoted_to_the_tiers_above(tmp_path):
    """A block found on disk (written by an earlier process) is loaded and copied into the host tier, whose next
    load serves it; the disk's entries are not read again."""
    ids = _prompt(64, seed=12)
    first = _fresh()
    reference = _generate(first, ids, {"dir": str(tmp_path)})
    get_pool(first).offload.flush()
    release_pool(first)
    again = _fresh()  # a new process's view: an empty host tier over the same directory
    tiers = {"dir": str(tmp_path), "host_bytes": "64MiB"}
    assert torch.equal(_generate(again, ids, tiers), reference)
    offload = get_pool(again).offload
    offload.flush()
    host, disk = offload.stats().tiers
    assert (host.tokens_loaded, disk.tokens_loaded) == (0, 56)
    assert host.writes >= 7 and host.entries >= 7  # the 7 blocks loaded from the disk, promoted
    release_pool(again)
    for path in tmp_path.rglob("*.safetensors"):
        path.unlink()  # only the host tier holds them now
    third = _fresh()
    get_pool(third, block_size=BLOCK, num_blocks=96).offload = offload
    assert torch.equal(_generate(third, ids, tiers), reference)
    host, disk = get_pool(third).offload.stats().tiers
    assert (host.tokens_loaded, disk.tokens_loaded) == (56, 56)


# ---------------------------------------------------------------------------- faults
class _FullDisk(DirectoryStore):
    """A directory on a disk that fills up after `room` bytes (as `write` on a full filesystem raises ENOSPC)."""

    room = 3 * 10**4

    def put(self, key, value):
        if self.nbytes() + len(value) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().put(key, value)


def test_a_full_disk_switches_the_tier_off_and_serving_goes_on(tmp_path, caplog):
    model = _fresh()
    offload = KVOffload(OffloadConfig(dir=str(tmp_path)), BLOCK)
    offload.tiers[0].store.__class__ = _FullDisk
    pool = get_pool(model, block_size=BLOCK, num_blocks=96)
    pool.offload = offload
    ids = _prompt(100, seed=12)
    with caplog.at_level("WARNING"):
        paged = model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="paged")
        offload.flush()
        paged_again = model.generate(
            _prompt(100, seed=13), max_new_tokens=8, do_sample=False, cache_implementation="paged"
        )
        offload.flush()
    (disk,) = offload.stats().tiers
    assert not disk.enabled and "No space left" in disk.error
    assert sum("tier" in r.getMessage() and "off from now on" in r.getMessage() for r in caplog.records) == 1
    release_pool(model)
    assert torch.equal(paged, model.generate(ids, max_new_tokens=8, do_sample=False))
    assert paged_again.shape == (1, 108)


def test_unwritable_directory_is_refused_at_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="kv_offload dir=.*cannot be written"):
        _generate(_fresh(), _prompt(20), {"dir": str(blocker / "kv")})
    with pytest.raises(ValueError, match="disk_bytes=.*needs a directory"):
        OffloadConfig.from_dict({"disk_bytes": "1GiB"})
    with pytest.raises(ValueError, match="unknown kv_offload key"):
        OffloadConfig.from_dict({"directory": "/tmp"})
    with pytest.raises(ValueError, match="kv_offload disk_bytes='lots' is not a memory size"):
        OffloadConfig.from_dict({"dir": "/tmp", "disk_bytes": "lots"})
    with pytest.raises(ValueError, match="with prefix_caching=False"):
        hf_paged.PagedCacheConfig.from_dict({"prefix_caching": False, "kv_offload": {"dir": str(tmp_path)}})


_WRITER = textwrap.dedent(
    """
    import sys
    from hf_paged.offload import DirectoryStore
    from hf_paged.offload.codec import encode
    import torch
    store = DirectoryStore(sys.argv[1], max_bytes=int(sys.argv[2]))
    print("ready", flush=True)
    index = int(sys.argv[3])
    while True:
        key = f"{index:032x}"
        store.put(key, encode(key, {"k.0": torch.full((256, 256), float(index))}))
        index += 2
    """
)


def _check_every_file(path) -> int:
    count = 0
    for file in path.rglob("*.safetensors"):
        tensors = decode(file.stem, file.read_bytes())  # raises on a half-written file
        assert torch.equal(tensors["k.0"], torch.full((256, 256), float(int(file.stem, 16))))
        count += 1
    return count


def test_killed_and_concurrent_writers_leave_only_whole_files(tmp_path):
    budget = 40 * 2**18
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(budget), str(start)], stdout=subprocess.PIPE
        )
        for start in (0, 1)
    ]
    for writer in writers:
        assert writer.stdout.readline().strip() == b"ready"
    time.sleep(2.0)  # both write and evict in one directory at once
    for writer in writers:
        writer.send_signal(signal.SIGKILL)  # mid-write, most likely
        writer.wait()
    assert _check_every_file(tmp_path) > 10
    total = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert total <= budget + 4 * 2**18  # each writer holds the budget over what it saw: within two files of it
    store = DirectoryStore(str(tmp_path), max_bytes=budget)  # a new process reads only whole files
    assert store.entries() == _check_every_file(tmp_path)


# ---------------------------------------------------------------------------- Redis
@pytest.fixture
def redis_url(tmp_path):
    with redis_server(tmp_path) as url:
        yield url


def test_redis_tier_reloads_across_models(redis_url):
    tiers = {"remote": redis_url}
    ids = _prompt(100, seed=14)
    first = _fresh()
    out_first = _generate(first, ids, tiers)
    get_pool(first).offload.flush()
    second = _fresh()
    out_second = _generate(second, ids, tiers)
    (remote,) = get_pool(second).offload.stats().tiers
    assert (remote.name, remote.tokens_loaded, remote.rejects) == ("remote", 96, 0)
    assert torch.equal(out_first, out_second)
    other = _fresh(seed=2)  # isolation through Redis too
    _generate(other, ids, tiers)
    assert _loaded(other) == 0


def test_redis_budget_and_unreachable_server(redis_url):
    store = RedisStore(redis_url, max_bytes=1000)
    for index in range(3):
        assert store.put(f"{index:04x}", bytes(300))
    assert not store.put("0002", bytes(300))  # held already
    assert store.get("0000") == bytes(300)  # used: now the most recent
    store.put("0003", bytes(300))
    assert store.nbytes() == 900 and store.entries() == 3 and store.evictions == 1
    assert store.contains("0000") and not store.contains("0001")
    store.delete("0000")
    assert store.nbytes() == 600 and store.get("0000") is None
    closed = free_port()
    with pytest.raises(ValueError, match=f"remote='redis://127.0.0.1:{closed}/0' cannot be reached"):
        RedisStore(f"redis://127.0.0.1:{closed}/0", max_bytes=1000, timeout=1.0)
    with pytest.raises(ValueError, match="is not a Redis URL"):
        OffloadConfig.from_dict({"remote": "http://localhost:6379"})


def _written_to_disk_and_redis(tmp_path, redis_url, seed: int):
    """Tiers of a directory and Redis, a 64-token prompt, the tokens of a first run over it and the directory's 8
    entry files it wrote (oldest first, the chain's order), every write done."""
    tiers = {"dir": str(tmp_path), "remote": redis_url}
    ids = _prompt(64, seed=seed)
    first = _fresh()
    reference = _generate(first, ids, tiers)
    get_pool(first).offload.flush()
    files = sorted(tmp_path.rglob("*.safetensors"), key=os.path.getmtime)
    assert len(files) == 8
    return tiers, ids, reference, files


def test_a_prefix_split_across_tiers_loads_whole_and_asks_redis_once(tmp_path, redis_url):
    """Blocks the disk lost are taken from Redis, the rest from the disk: one run of 8 blocks, the remote store
    asked in one round trip (one MGET) for every block the disk lacked, and those blocks promoted to the disk."""
    import redis

    tiers, ids, reference, files = _written_to_disk_and_redis(tmp_path, redis_url, seed=17)
    for lost in (files[2], files[5]):
        lost.unlink()
    client = redis.Redis.from_url(redis_url)
    client.config_resetstat()
    again = _fresh()
    assert torch.equal(_generate(again, ids, tiers), reference)
    offload = get_pool(again).offload
    offload.flush()
    disk, remote = offload.stats().tiers
    assert (disk.tokens_loaded, remote.tokens_loaded) == (5 * BLOCK, 2 * BLOCK)  # 7 blocks: 56 of the 64 tokens
    assert client.info("commandstats")["cmdstat_mget"]["calls"] == 1
    assert len(list(tmp_path.rglob("*.safetensors"))) == 8  # promoted back to the disk


def test_a_damaged_entry_is_taken_from_the_tier_below(tmp_path, redis_url):
    """A disk entry that fails its checks is a reject there, and the same block is read from Redis instead: the
    whole prefix still loads."""
    tiers, ids, reference, files = _written_to_disk_and_redis(tmp_path, redis_url, seed=19)
    files[2].write_bytes(files[2].read_bytes()[:100])  # truncated on the disk; whole in Redis
    again = _fresh()
    assert torch.equal(_generate(again, ids, tiers), reference)
    disk, remote = get_pool(again).offload.stats().tiers
    assert (disk.rejects, disk.tokens_loaded, remote.tokens_loaded) == (1, 6 * BLOCK, 1 * BLOCK)


def test_a_block_no_tier_holds_ends_the_loaded_run(tmp_path):
    """Blocks past a hole are not loaded, nor even decoded: a damaged entry there is not read (no reject)."""
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(64, seed=18)
    reference = _generate(_fresh(), ids, tiers)
    files = sorted(tmp_path.rglob("*.safetensors"), key=os.path.getmtime)
    files[3].unlink()  # blocks 4-7 are on the disk, but a prefix cannot skip block 3
    files[5].write_bytes(files[5].read_bytes()[:100])  # truncated: a reject, were it decoded
    model = _fresh()
    assert torch.equal(_generate(model, ids, tiers), reference)
    pool = get_pool(model)
    disk = pool.offload.stats().tiers[0]
    assert (disk.tokens_loaded, disk.rejects) == (3 * BLOCK, 0)
    pool.allocator.check_invariants()


def test_a_load_that_fails_while_copying_gives_its_blocks_back(tmp_path, monkeypatch):
    """Blocks adopted for a load whose copy into the pool raises are not left indexed with unwritten K/V: the error
    reaches the caller, the pool stays consistent, and the next call computes the prompt."""
    tiers = {"dir": str(tmp_path)}
    ids = _prompt(64, seed=19)
    reference = _generate(_fresh(), ids, tiers)
    model = _fresh()
    pool = get_pool(model, block_size=BLOCK, num_blocks=96)

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("simulated: no memory for the copy")

    monkeypatch.setattr(type(pool.storage), "load_blocks", out_of_memory)
    with pytest.raises(RuntimeError, match="simulated"):
        _generate(model, ids, tiers)
    pool.allocator.check_invariants()
    assert pool.allocator.num_free == 96 and not pool.allocator._block_hash
    monkeypatch.undo()
    assert torch.equal(_generate(model, ids, tiers), reference)


def test_redis_lost_mid_run_switches_the_tier_off(redis_url, caplog):
    tiers = {"remote": redis_url}
    model = _fresh()
    _generate(model, _prompt(64, seed=15), tiers)
    offload = get_pool(model).offload
    offload.flush()
    import redis

    redis.Redis.from_url(redis_url).shutdown(nosave=True)
    with caplog.at_level("WARNING"):
        paged = _generate(model, _prompt(64, seed=16), tiers)
        offload.flush()
    (remote,) = offload.stats().tiers
    assert not remote.enabled
    release_pool(model)
    assert torch.equal(paged, model.generate(_prompt(64, seed=16), max_new_tokens=8, do_sample=False))
