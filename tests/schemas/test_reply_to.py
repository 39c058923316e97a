"""The one rule for a request's reply_to (schemas/topics.py: Topics.reply_to_problem)."""

from __future__ import annotations

import pytest

from schemas.topics import MAX_TOPIC_CHARS, Topics, topic_name_problem

WEIR = Topics("weir")


@pytest.mark.parametrize(
    "name",
    [
        "weir.replies.kcat",  # weir topics create --reply kcat, the README's kcat example
        "weir.replies.my-app",  # the README's aiokafka example
        "weir.replies.gateway-up-8000",  # weir up's gateway
        "weir.replies.job.batch_abc123",  # a batch job's
        "weir.replies.a",
        "weir.replies.a.b_c-D.9",
        "weir.replies." + "x" * (MAX_TOPIC_CHARS - len("weir.replies.")),  # 249 characters
    ],
)
def test_reply_topics_of_the_deployment_are_accepted(name):
    assert WEIR.reply_to_problem(name) is None


def test_names_made_by_topics_are_accepted():
    topics = Topics("t-1_x")
    for name in (topics.replies("gateway-abc"), topics.replies("bad id! é"), topics.job_replies("job/1")):
        assert topics.reply_to_problem(name) is None, name


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("bad topic!", "not a legal Kafka topic name"),
        ("weir.replies.bad topic!", "not ' !'"),
        (
            "weir.replies." + "x" * (MAX_TOPIC_CHARS + 1 - len("weir.replies.")),
            "at most 249 characters, this one has 250",
        ),
        ("", "cannot be empty"),
        (".", "not a legal topic name"),
        ("..", "not a legal topic name"),
        ("weir.replies.café", "not 'é'"),  # unicode letters are not legal
        ("weir.replies.１", "not '１'"),  # full-width digit
        ("weir.replies.ａ", "not 'ａ'"),  # full-width letter
        ("weir.replies.a\n", "not '\\n'"),  # a trailing newline ($ would let it through)
        ("weir.replies.a/b", "not '/'"),
        ("weir.replies", "it must be weir.replies.<name>"),  # the namespace without a name
        ("weir.replies.", "it must be weir.replies.<name>"),  # the namespace itself
        ("weir.repliesX", "not one of this deployment's reply topics"),  # a look-alike
        ("weir.repliesX.a", "not one of this deployment's reply topics"),
        ("weir_replies_a", "not one of this deployment's reply topics"),
        ("Weir.replies.a", "not one of this deployment's reply topics"),  # topic names are case-sensitive
        ("weirx.replies.a", "not one of this deployment's reply topics"),
        ("other.replies.a", "not one of this deployment's reply topics"),  # another deployment's
        ("weir.requests", "not one of this deployment's reply topics"),
        ("weir.keys", "not one of this deployment's reply topics"),
    ],
)
def test_refused_reply_to_says_why(name, says):
    problem = WEIR.reply_to_problem(name)
    assert problem is not None and says in problem, problem


@pytest.mark.parametrize("value", [None, 7, ["weir.replies.a"], b"weir.replies.a"])
def test_a_reply_to_that_is_not_a_string_is_refused(value):
    assert "is a string" in WEIR.reply_to_problem(value)


def test_another_deployments_reply_topic_is_refused():
    assert Topics("weir").reply_to_problem(Topics("blue").replies("a")) is not None
    assert Topics("blue").reply_to_problem(Topics("weir").replies("a")) is not None
    # A prefix that extends another one's does not share its reply topics.
    assert Topics("weir").reply_to_problem(Topics("weir2").replies("a")) is not None


@pytest.mark.parametrize("prefix", ["weir", "t1234abcd", "a.b"])
def test_no_internal_topic_is_a_reply_topic(prefix):
    topics = Topics(prefix)
    internal = [spec.name for spec in topics.core_specs()] + [spec.name for spec in topics.model_specs("weir-tiny-py")]
    assert {topics.requests, topics.keys, topics.usage, topics.audit, topics.control, topics.dead_letter} <= set(
        internal
    )
    for name in internal:
        assert topics.reply_to_problem(name) is not None, name


def test_topic_name_rule_matches_kafkas():
    assert topic_name_problem("a" * 249) is None
    assert topic_name_problem("a" * 250) is not None
    assert topic_name_problem("...") is None  # only "." and ".." are reserved
    assert topic_name_problem("_-.") is None
