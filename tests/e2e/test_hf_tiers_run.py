"""`kvmesh run --engine hf` with KV tiers from the command line: a prompt evicted from a
16-block device pool by a second one comes back from the host/disk tiers (cached tokens)
with the same greedy text."""

from __future__ import annotations

import openai
import pytest

from tests.helpers import kvmesh_run

pytest.importorskip("torch")

pytestmark = pytest.mark.processes


@pytest.mark.timeout(120)
def test_an_evicted_prompt_comes_back_from_the_tiers_with_the_same_text(tmp_path):
    first = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(12))  # ~10 blocks
    second = "".join(f"class C{i}:\n    value = {i}\n\n" for i in range(20))[:600]  # most of the pool
    kv_dir = tmp_path / "kv"
    args = ("--engine", "hf", "--device", "cpu", "--hf-threads", "1", "--canary-interval", "0", "--hf-num-blocks", "16",
            "--hf-host-kv-blocks", "4", "--hf-disk-kv-blocks", "32", "--hf-disk-kv-path", str(kv_dir))  # fmt: skip
    with kvmesh_run(tmp_path, *args, workers=1) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = []
        for prompt in (first, second, first):
            resp = client.completions.create(model="kvmesh-tiny", prompt=prompt, max_tokens=4, temperature=0)
            details = resp.usage.prompt_tokens_details
            out.append((resp.choices[0].text, details.cached_tokens if details else 0, resp.usage.prompt_tokens))
        assert list(kv_dir.iterdir()) == []  # the disk tier's file is mapped and unlinked
    (text1, cached1, n1), (_, _, n2), (text3, cached3, _) = out
    assert n2 >= 100 and n1 + n2 > 16 * 16  # the second prompt evicts the first from the device pool
    assert cached1 == 0 and cached3 >= 128, out  # ... and it came back from the tiers
    assert text3 == text1
