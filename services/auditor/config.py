"""Settings of the auditor: the only module of the service that reads the environment."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from schemas.fingerprint import parse_key
from weir.bus import BusSettings


class AuditorSettings(BusSettings):
    """Kafka settings plus where the ledger lives (env WEIR_AUDIT_DB, WEIR_AUDIT_HMAC_KEY,
    WEIR_AUDIT_RETRY_BACKOFF_S)."""

    audit_db: Path = Field(Path("var/audit.sqlite"), description="SQLite file of the hash-chained audit log.")
    audit_hmac_key: SecretStr | None = Field(
        None,
        description="Key the workers' fingerprints are made with ('hex:<digits>' or UTF-8 text); "
        "only lookups of a text need it, appending and verifying do not.",
    )
    audit_retry_backoff_s: float = Field(
        1.0, ge=0, description="Wait before an event whose ledger write failed is redelivered."
    )

    def hmac_key(self) -> bytes:
        """The fingerprint key as bytes; ValueError naming the setting when it is not set."""
        if self.audit_hmac_key is None or not self.audit_hmac_key.get_secret_value():
            raise ValueError("WEIR_AUDIT_HMAC_KEY is not set; set it to the workers' fingerprint key")
        return parse_key(self.audit_hmac_key.get_secret_value())
