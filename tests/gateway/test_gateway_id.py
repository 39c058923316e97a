"""The gateway's reply topic passes the rule every service applies to reply_to (schemas/topics.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.gateway.config import GatewaySettings


def test_a_gateway_id_whose_reply_topic_would_be_refused_is_a_setting_error():
    settings = GatewaySettings(gateway_id="gateway-up-8000", topic_prefix="weir")
    assert settings.topics.reply_to_problem(settings.topics.replies("gateway-up-8000")) is None
    with pytest.raises(ValidationError, match=r"WEIR_GATEWAY_ID.*at most 249 characters"):
        GatewaySettings(gateway_id="g" * 240, topic_prefix="weir")
