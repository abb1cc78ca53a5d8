"""`kvpool router --prefill URL ... --decode URL ...`: the flags give a disaggregated config (each
URL in its role); `--replica` with either is an argparse error, as is one of the two without
the other, or no replica at all; a URL in both roles is a one-line error. `RouterConfig` keeps
the same rules for those who build it directly."""

from __future__ import annotations

import pytest

from kvpool.cli import build_parser, main
from kvpool.cli.router import router_config_from_args
from kvpool.router.config import RouterConfig


def test_prefill_and_decode_flags_build_a_disaggregated_config() -> None:
    args = build_parser().parse_args(["router", "--prefill", "http://p:1/", "--prefill=http://p:2",
                                      "--decode", "http://d:1"])
    config = router_config_from_args(args)
    assert (config.replicas, config.prefill, config.decode) \
        == ((), ("http://p:1", "http://p:2"), ("http://d:1",))
    assert config.is_disaggregated
    assert config.roles == {"http://p:1": "prefill", "http://p:2": "prefill",
                            "http://d:1": "decode"}
    plain = RouterConfig(replicas=("http://a:1",))
    assert not plain.is_disaggregated and plain.roles == {"http://a:1": "both"}


@pytest.mark.parametrize("flags, message", [
    (["--replica", "http://a:1", "--prefill", "http://p:1", "--decode", "http://d:1"],
     "argument --prefill/--decode: not allowed with argument --replica"),
    (["--replica", "http://a:1", "--decode", "http://d:1"],
     "argument --prefill/--decode: not allowed with argument --replica"),
    (["--prefill", "http://p:1"], "argument --prefill: needs --decode too"),
    (["--decode", "http://d:1"], "argument --decode: needs --prefill too"),
    ([], "one of the arguments --replica or --prefill/--decode is required"),
])
def test_the_replica_flags_exclude_or_need_each_other(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", *flags])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("usage: kvpool router") and f"kvpool router: error: {message}" in error


def test_a_url_in_both_roles_is_a_one_line_error(capsys) -> None:
    assert main(["router", "--prefill", "http://w:1", "--decode", "http://w:1"]) == 2
    assert "only once (and in one role)" in capsys.readouterr().err


@pytest.mark.parametrize("urls, message", [
    ({"prefill": ("http://p:1",)}, "at least one prefill worker"),
    ({"decode": ("http://d:1",)}, "at least one prefill worker"),
    ({"replicas": ("http://a:1",), "prefill": ("http://p:1",), "decode": ("http://d:1",)},
     "not both"),
    ({"prefill": ("p:1",), "decode": ("http://d:1",)}, "expected http://host:port"),
    ({}, "at least one replica"),
])
def test_router_config_refuses_a_bad_set_of_workers(urls, message) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**urls)
