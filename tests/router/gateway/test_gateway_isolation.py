"""Isolation levels and scoped invalidation on real processes: a gateway and emulated workers
on 127.0.0.1, tenants by API key, the worker's own `cached_tokens` as the judge."""

from __future__ import annotations

import httpx

from tests.gateway import ADMIN, all_exact
from tests.processes import wait_for
from urc.processes import start_gateway, start_worker

SYSTEM = "You are a careful assistant of the Example Corporation. " * 18  # ~1,000 tokens


def key(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer key-{name}"}


def cached(url: str, tenant: str, body: dict) -> int:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=key(tenant), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def matched(url: str, tenant: str, body: dict) -> list[int]:
    """What the gateway's index holds of this tenant's prompt, per worker (a dry run)."""
    r = httpx.post(f"{url}/admin/route?tenant={tenant}", json=body, headers=ADMIN, timeout=10)
    assert r.status_code == 200, r.text
    return [c["matched_tokens"] for c in r.json()["candidates"]]


def chat(user: str, system: str | None = None) -> dict:
    msgs = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": user}
    ]
    return {"model": "emulated", "messages": msgs, "max_tokens": 3}


def invalidate(url: str, **body: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/invalidate", json=body, headers=ADMIN, timeout=30)


def test_invalidating_a_tenant_drops_its_cache_everywhere_and_nothing_else(start_fleet):
    keys = ("--api-key", "acme:key-acme", "--api-key", "beta:key-beta")
    gateway, _ = start_fleet(2, gateway_args=keys)
    url = gateway.url
    bodies = {t: chat(f"{t} asks about its own long document. " * 20) for t in ("acme", "beta")}
    for tenant, body in bodies.items():
        cached(url, tenant, body)
        assert wait_for(lambda t=tenant, b=body: max(matched(url, t, b)) > 0)
        assert cached(url, tenant, body) > 0
    before_beta = cached(url, "beta", bodies["beta"])

    r = invalidate(url, scope="tenant", tenant="acme")
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["index_blocks_dropped"] > 0
    statuses = {w["status"] for w in answer["workers"].values()}
    assert statuses == {"invalidated"}
    assert sum(w["freed_blocks"] for w in answer["workers"].values()) > 0
    # the index holds none of acme's keys the moment the call returns
    assert matched(url, "acme", bodies["acme"]) == [0, 0]
    assert cached(url, "acme", bodies["acme"]) == 0  # and no worker serves them
    assert cached(url, "beta", bodies["beta"]) == before_beta  # beta's hits untouched
    assert max(matched(url, "beta", bodies["beta"])) > 0

    metrics = httpx.get(f"{url}/metrics", headers=ADMIN).text
    assert 'urc_invalidations_total{scope="tenant"} 1.0' in metrics
    assert "urc_invalidated_blocks_total" in metrics

    r = invalidate(url, scope="user", tenant="acme", user="u1")
    assert r.status_code == 409 and "isolated per tenant" in r.json()["error"]["message"]
    assert invalidate(url, scope="tenant", tenant="nobody").status_code == 404
    assert invalidate(url, scope="everything").status_code == 400
    assert invalidate(url, scope="model").status_code == 400  # needs a model
    r = httpx.post(f"{url}/admin/invalidate", json={"scope": "all"}, timeout=10)
    assert r.status_code == 401  # behind the admin key

    r = invalidate(url, scope="all")
    assert r.status_code == 200 and r.json()["index_blocks_dropped"] > 0
    assert cached(url, "beta", bodies["beta"]) == 0


def test_shared_tenants_reuse_a_public_system_prompt_and_nothing_else():
    worker = start_worker()
    tenants = ("shop", "bank", "solo")
    flags = [f for t in tenants for f in ("--api-key", f"{t}:key-{t}")]
    flags += ["--tenant-isolation", "shop:shared", "--tenant-isolation", "bank:shared"]
    gateway = start_gateway([worker.url], *flags, "--admin-key", "admin-secret")
    try:
        url = gateway.url
        assert wait_for(lambda: all_exact(url, 1), 20)
        levels = httpx.get(f"{url}/admin/tenants", headers=ADMIN, timeout=10).json()["tenants"]
        assert {t["name"]: t["isolation"] for t in levels} == {
            "shop": "shared",
            "bank": "shared",
            "solo": "tenant",
        }
        metrics = httpx.get(f"{url}/metrics", headers=ADMIN, timeout=10).text
        assert 'urc_tenant_isolation{isolation="shared",tenant="bank"} 1.0' in metrics
        shop = chat("shop's private question about order 1234. " * 6, SYSTEM)
        bank = chat("bank's private question about account 9. " * 6, SYSTEM)
        assert cached(url, "shop", shop) < 64  # cold (but for the template's opening block)
        assert wait_for(lambda: matched(url, "bank", bank)[0] > 0)
        public = matched(url, "bank", bank)[0]  # the index predicts the public part
        assert 960 <= public < 1000 + 16  # the ~1,000-token system prompt, whole blocks
        assert cached(url, "bank", bank) == public  # reused across tenants
        # the private suffixes (~250 tokens) never hit across tenants, in either direction
        # (a tenant may reuse its own block of the template's turn markers after the prompt)
        assert public <= cached(url, "shop", bank) <= public + 16
        assert public <= cached(url, "bank", shop) <= public + 16
        assert cached(url, "bank", bank) > public + 200  # but each tenant's own do
        assert cached(url, "solo", shop) == 0  # a tenant-level tenant shares nothing
        assert cached(url, "solo", shop) > public  # (its own cache works)

        # invalidating one shared tenant drops its private blocks, not the public prompt
        assert invalidate(url, scope="tenant", tenant="bank").status_code == 200
        assert cached(url, "bank", bank) == public
        assert cached(url, "shop", shop) > public + 200
    finally:
        gateway.stop()
        worker.stop()


def test_an_engine_that_cannot_drop_part_of_its_cache_is_only_routed_around(tmp_path):
    worker = start_worker()
    config = tmp_path / "gateway.toml"  # described, not discovered: as a vLLM engine would be
    config.write_text(f'[[workers]]\nurl = "{worker.url}"\nmodels = ["emulated"]\n')
    flags = ("--api-key", "acme:key-acme", "--admin-key", "admin-secret")
    gateway = start_gateway([], "--config", str(config), *flags)
    try:
        url = gateway.url
        body = chat("acme's question about a long contract. " * 20)
        assert wait_for(lambda: httpx.get(f"{url}/health").status_code == 200, 20)
        cached(url, "acme", body)
        assert matched(url, "acme", body)[0] > 0  # approximate residency from routing
        r = invalidate(url, scope="tenant", tenant="acme")
        assert r.status_code == 200
        (answer,) = r.json()["workers"].values()
        assert answer["status"] == "unroutable" and "still holds" in answer["detail"]
        assert matched(url, "acme", body) == [0]  # no longer routed on
        assert cached(url, "acme", body) > 0  # as the answer said: the engine still has it
    finally:
        gateway.stop()
        worker.stop()
