"""Manifests and their signatures, without Kafka: a worker must refuse a changed, missing or extra
file by name, and a manifest that is unsigned (where required), signed by a key it does not trust,
or changed after signing (docs/design.md, invariant 10)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from schemas.model_repo import ModelConfig
from schemas.registry import ModelVersionRecord
from weir.models import cli
from weir.models.manifest import ManifestError, pack, read_manifest_file, verify_files, write_manifest_file
from weir.models.signing import SigningError, generate_keypair, load_trusted_keys, sign, signature_problem


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    where = tmp_path / "m"
    (where / "sub").mkdir(parents=True)
    (where / "config.json").write_text('{"a": 1}')
    (where / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    (where / "sub" / "tokenizer.json").write_text("{}")
    return where


def _manifest(where: Path, version: str = "1"):
    return pack(ModelConfig(name="m", version=version, path=where, engine="torch"), where)


def test_a_flipped_byte_is_refused_naming_the_file(model_dir: Path) -> None:
    manifest = _manifest(model_dir)
    verify_files(manifest, model_dir)  # as packed: fine
    data = bytearray((model_dir / "model.safetensors").read_bytes())
    data[1000] ^= 0x01  # same size: only the sha256 can tell
    (model_dir / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"model\.safetensors has sha256 .* the file changed"):
        verify_files(manifest, model_dir)


def test_an_extra_or_missing_file_is_refused_naming_it(model_dir: Path) -> None:
    manifest = _manifest(model_dir)
    (model_dir / "sub" / "extra.bin").write_bytes(b"x")
    with pytest.raises(ManifestError, match=r"sub/extra\.bin .* is not in the manifest"):
        verify_files(manifest, model_dir)
    (model_dir / "sub" / "extra.bin").unlink()
    (model_dir / "sub" / "tokenizer.json").unlink()
    with pytest.raises(ManifestError, match=r"sub/tokenizer\.json is missing"):
        verify_files(manifest, model_dir)


def test_a_manifest_file_inside_the_directory_changes_nothing(model_dir: Path, capsys) -> None:
    before = _manifest(model_dir)
    out = model_dir / "m@1.manifest.json"
    assert cli.main(["pack", str(model_dir), "--name", "m", "--version", "1", "--out", str(out)]) == 0
    assert str(out) in capsys.readouterr().out
    verify_files(before, model_dir)  # the manifest file is not an extra file
    manifest, signature = read_manifest_file(out)
    assert signature is None
    assert [f.path for f in manifest.files] == [f.path for f in before.files]
    assert manifest.files == before.files


def test_pack_writes_next_to_the_directory_by_default_and_signs(model_dir: Path, tmp_path: Path) -> None:
    generate_keypair(tmp_path / "k.key", tmp_path / "k.pub")
    assert cli.main(["pack", str(model_dir), "--name", "m", "--version", "2", "--engine", "onnx",
                     "--max-model-len", "64", "--sign-key", str(tmp_path / "k.key")]) == 0
    manifest, signature = read_manifest_file(tmp_path / "m@2.manifest.json")
    assert manifest.format == "onnx" and manifest.serving["max_model_len"] == 64
    record = ModelVersionRecord(manifest=manifest, signature=signature)
    assert signature_problem(record, load_trusted_keys(tmp_path), required=True) is None


def test_engine_auto_is_resolved_from_the_directory(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    assert cli.main(["pack", str(model_dir), "--name", "m", "--version", "1", "--out", str(out)]) == 0
    manifest, _ = read_manifest_file(out)
    assert (manifest.serving["engine"], manifest.format) == ("torch", "safetensors")
    (model_dir / "model.onnx").write_bytes(b"onnx")
    assert cli.main(["pack", str(model_dir), "--name", "m", "--version", "1", "--out", str(out)]) == 0
    manifest, _ = read_manifest_file(out)
    assert (manifest.serving["engine"], manifest.format) == ("onnx", "onnx")


def test_a_malformed_manifest_file_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "x.manifest.json"
    bad.write_text('{"manifest": {"name": "m"}}')
    with pytest.raises(ManifestError, match="x.manifest.json: not a manifest file"):
        read_manifest_file(bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["pack", "DIR", "--name", "m", "--version", "1", "--engine", "echo"], "engine echo has no files"),
        (["pack", "--name", "m", "--version", "1"], "engine auto needs the model directory"),
        (["pack", "DIR", "--name", "m", "--version", "bad version"], "version"),
        (["pack", "DIR", "--name", "nope", "--version", "1", "--from-toml", "models.toml"], "has no entry"),
        (["pack", "DIR", "--name", "m", "--version", "1", "--max-model-len", "1"], "max_model_len"),
        (["keygen", "--private", "DIR", "--public", "DIR/k.pub"], "exists; refusing to overwrite"),
        (["pack", "DIR", "--name", "m"], "the following arguments are required: --version"),
        (["promote", "m@1", "--live-ms"], "--live-ms: expected one argument"),
        (["load", "m@1", "--live-ms", "5"], "unrecognized arguments: --live-ms 5"),
        (["promote", "m"], "'m' names no version: use NAME@VERSION"),
        (["show", "m@"], "'m@': version '' must be"),
        (["unload", "@1"], "the model name must be non-empty"),
        (["retire", "m@@3"], "without spaces or '@'"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(model_dir: Path, capsys, argv: list[str], message: str) -> None:
    argv = [a.replace("DIR", str(model_dir)) for a in argv]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"weir models {argv[0]}: error: ") and err.count("\n") == 1
    assert message in err


def test_keygen_makes_a_private_key_only_its_owner_reads(tmp_path: Path) -> None:
    kid = generate_keypair(tmp_path / "a.key", tmp_path / "a.pub")
    assert stat.S_IMODE((tmp_path / "a.key").stat().st_mode) == 0o600
    assert len(kid) == 16 and kid in load_trusted_keys(tmp_path)
    with pytest.raises(SigningError, match="a.pub exists"):
        generate_keypair(tmp_path / "b.key", tmp_path / "a.pub")
    assert not (tmp_path / "b.key").exists()  # nothing written when refused


def test_signatures_valid_unknown_tampered_and_unsigned(model_dir: Path, tmp_path: Path) -> None:
    keys = tmp_path / "trusted"
    keys.mkdir()
    generate_keypair(tmp_path / "good.key", keys / "good.pub")
    generate_keypair(tmp_path / "other.key", tmp_path / "other.pub")  # not in the trusted directory
    trusted = load_trusted_keys(keys)
    manifest = _manifest(model_dir)

    signed = ModelVersionRecord(manifest=manifest, signature=sign(manifest, tmp_path / "good.key"))
    assert signature_problem(signed, trusted, required=True) is None
    assert signature_problem(signed, trusted, required=False) is None

    other = sign(manifest, tmp_path / "other.key")
    stranger = ModelVersionRecord(manifest=manifest, signature=other)
    assert signature_problem(stranger, trusted, required=False) == f"signed by unknown key {other.key_id}"

    changed = manifest.model_copy(update={"serving": {**manifest.serving, "max_model_len": 16}})
    tampered = ModelVersionRecord(manifest=changed, signature=signed.signature)
    assert signature_problem(tampered, trusted, required=False) == "bad signature: the manifest was changed after signing"

    unsigned = ModelVersionRecord(manifest=manifest)
    assert signature_problem(unsigned, trusted, required=True) == "unsigned manifest, signatures are required"
    assert signature_problem(unsigned, trusted, required=False) is None


def test_a_bad_trusted_key_file_is_an_error_naming_it(tmp_path: Path) -> None:
    (tmp_path / "broken.pub").write_text("-----BEGIN PUBLIC KEY-----\nnot a key\n-----END PUBLIC KEY-----\n")
    with pytest.raises(SigningError, match="broken.pub"):
        load_trusted_keys(tmp_path)
    with pytest.raises(SigningError, match="does not exist"):
        load_trusted_keys(tmp_path / "missing")
