"""The trial secret's file, its derived keys and the HTTP bearer gate (docs/design.md §14)."""

from __future__ import annotations

import asyncio
import os
import stat

import aiohttp
import pytest
from aiohttp import web

from realrl.base import trial_secret
from realrl.base.http_auth import BearerGate
from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher


def test_hkdf_matches_rfc5869_test_case_1():
    ikm = bytes.fromhex("0b" * 22)
    salt = bytes.fromhex("000102030405060708090a0b0c")
    info = bytes.fromhex("f0f1f2f3f4f5f6f7f8f9")
    okm = trial_secret.hkdf_sha256(ikm, info, 42, salt)
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c5db02d56ecc4c5bf34007208d5b887185865")


def test_the_secret_is_private_from_creation_and_kept_by_a_resume(tmp_path):
    run_dir = str(tmp_path / "run" / "exp" / "t")
    path = trial_secret.ensure_secret(run_dir)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    first = trial_secret.read_secret(path)
    assert len(first) == 32
    assert trial_secret.ensure_secret(run_dir) == path and trial_secret.read_secret(path) == first  # a resume
    assert sorted(os.listdir(run_dir)) == ["secret"]  # no temporary file left behind
    other = trial_secret.read_secret(trial_secret.ensure_secret(str(tmp_path / "run" / "exp" / "t2")))
    assert other != first  # a new trial, a new secret


def test_an_exposed_or_damaged_secret_is_refused(tmp_path):
    path = trial_secret.ensure_secret(str(tmp_path))
    os.chmod(path, 0o644)
    with pytest.raises(trial_secret.SecretError, match="readable by others"):
        trial_secret.ensure_secret(str(tmp_path))
    os.chmod(path, 0o600)
    with open(path, "ab") as f:
        f.write(b"x")
    with pytest.raises(trial_secret.SecretError, match="33 bytes"):
        trial_secret.read_secret(path)


def test_each_use_has_its_own_key_and_none_is_printed(tmp_path):
    keys = trial_secret.load_keys(trial_secret.ensure_secret(str(tmp_path)))
    secret = trial_secret.read_secret(trial_secret.secret_path(str(tmp_path)))
    derived = [
        bytes.fromhex(keys.http_api_key),
        keys.stream_mac_key,
        keys.control_key,
        bytes.fromhex(keys.etcd_password),
    ]
    assert len(set(derived)) == 4 and secret not in derived
    assert keys.http_api_key not in repr(keys) and secret.hex() not in repr(keys)


def test_the_launcher_creates_the_secret_when_it_claims_the_trial_and_names_it_in_the_specs(tmp_path):
    launcher = LocalLauncher("exp", "t", str(tmp_path), NameResolveConfig(type="memory"))
    launcher.acquire_trial()
    try:
        assert launcher.secret_path == str(tmp_path / "run" / "exp" / "t" / "secret")
        assert len(trial_secret.read_secret(launcher.secret_path)) == 32
    finally:
        launcher.release_trial()
    off = LocalLauncher("exp", "t3", str(tmp_path), NameResolveConfig(type="memory"), security=False)
    off.acquire_trial()
    off.release_trial()
    assert off.secret_path == "" and not os.path.exists(tmp_path / "run" / "exp" / "t3" / "secret")


def test_the_gate_answers_401_before_the_handler_and_counts_it():
    gate = BearerGate("k" * 64)
    ran: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        ran.append(request.path)
        return web.json_response({})

    async def main() -> list[int]:
        app = web.Application(middlewares=[gate.middleware])
        app.router.add_post("/stop", handler)
        app.router.add_get("/health", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        statuses = []
        try:
            async with aiohttp.ClientSession() as s:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k" * 64}):
                    async with s.post(url + "/stop", json={}, headers=headers) as r:
                        statuses.append(r.status)
                async with s.get(url + "/health") as r:
                    statuses.append(r.status)
                async with s.post(url + "/stop", json={}, headers={"Authorization": "Bearer " + "k" * 64}) as r:
                    statuses.append(r.status)
        finally:
            await runner.cleanup()
        return statuses

    assert asyncio.run(main()) == [401, 401, 401, 200, 200]
    assert ran == ["/health", "/stop"] and gate.refused == 3
