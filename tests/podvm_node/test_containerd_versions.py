"""Which containerd releases `podvm-node install` takes, and the config version it writes
for each: the known table (1.6 to 2.3; 2.3's own config version is 4 and it reads 3), a
later 2.x only while its own `containerd config default` says 3 or 4. The last test asks
the real binary: Debian's 1.6 here. containerd 2.3.4, which CI cannot fetch, was checked
by hand the same way (built by ../shared/tools/build-verify-tools.sh: release (2, 3), its
own default config version 4); a test that skips without it has no place in a suite where
nothing skips."""
from __future__ import annotations

import pathlib
import re
import tomllib

import pytest

from podvm_node import containerd_dropin as dropin
from podvm_node import hostcheck
from podvm_node.containerd_dropin import Refusal
from testbed.prereqs import require_tool

V234 = "containerd github.com/containerd/containerd/v2 v2.3.4 0123456789abcdef\n"
DEFAULT_V3 = "disabled_plugins = []\nimports = []\noom_score = 0\nversion = 3\n\n[grpc]\n"
DEFAULT_V4 = DEFAULT_V3.replace("version = 3", "version = 4")
DEFAULT_V5 = DEFAULT_V3.replace("version = 3", "version = 5")


def never_asked() -> str:
    raise AssertionError("a release in the table needs no `containerd config default`")


def host(tmp_path: pathlib.Path, config: str | None) -> str:
    if config is not None:
        (tmp_path / "etc/containerd").mkdir(parents=True)
        (tmp_path / "etc/containerd/config.toml").write_text(config)
    return str(tmp_path)


@pytest.mark.parametrize("release,versions", [((1, 6), (2,)), ((1, 7), (2,)), ((2, 0), (3,)),
                                              ((2, 2), (3,)), ((2, 3), (3, 4))])
def test_the_known_releases(release, versions) -> None:
    assert dropin.release_config_versions(release, never_asked) == versions


@pytest.mark.parametrize("config,version", [(None, 4), ("version = 4\n", 4),
                                            ("version = 3\n", 3)])
def test_containerd_2_3_4_takes_config_toml_s_version_or_its_own(tmp_path, config,
                                                                  version) -> None:
    plan = dropin.plan(host(tmp_path, config), dropin.parse_version(V234), never_asked)
    assert plan.version == version
    dropin_data = tomllib.loads(plan.dropin_text)
    assert dropin_data["version"] == version
    assert set(dropin_data["plugins"][dropin.CRI_V3]["containerd"]["runtimes"]) == \
        {"podvm", "podvm-sandboxer"}
    if config is None:
        assert plan.edit.text.startswith("version = 4\n")


def test_containerd_2_3_4_refuses_a_version_2_config(tmp_path) -> None:
    with pytest.raises(Refusal, match=r"containerd 2.3 with a version 2 .*config.toml: "
                                      r"podvm-node writes version 3 or 4 \(containerd "
                                      r"config migrate\): nothing changed"):
        dropin.plan(host(tmp_path, "version = 2\n"), (2, 3), never_asked)


def test_the_socket_of_a_version_4_config_is_the_grpc_server_plugin_s() -> None:
    v4 = tomllib.loads("version = 4\n[plugins.'io.containerd.server.v1.grpc']\n"
                       "  address = '/run/k/containerd.sock'\n")
    assert dropin.socket(v4) == "/run/k/containerd.sock"
    assert dropin.socket({"version": 3, "grpc": {"address": "/x.sock"}}) == "/x.sock"
    assert dropin.socket({"version": 4}) == "/run/containerd/containerd.sock"


@pytest.mark.parametrize("default,versions", [(DEFAULT_V3, (3,)), (DEFAULT_V4, (3, 4))])
def test_a_later_2_x_is_taken_while_its_default_config_is_3_or_4(tmp_path, default,
                                                                 versions) -> None:
    release = dropin.parse_version("containerd containerd.io v2.4.0 abc\n")
    assert dropin.release_config_versions(release, lambda: default) == versions
    assert dropin.plan(host(tmp_path, None), release, lambda: default).version == versions[-1]
    assert dropin.release_config_versions((2, 9), lambda: default) == versions


@pytest.mark.parametrize("default,said", [
    (DEFAULT_V5, "containerd 2.4 has config version 5 (`containerd config default`), not "
                 "one podvm-node knows"),
    (None, "containerd 2.4 is newer than podvm-node knows (2.3) and its `containerd "
           "config default` names no config version"),
    ("", "names no config version")])
def test_a_later_2_x_on_another_config_version_is_refused(default, said) -> None:
    with pytest.raises(Refusal, match="nothing changed") as refused:
        dropin.release_config_versions((2, 4), lambda: default)
    assert said in str(refused.value)


@pytest.mark.parametrize("release", [(3, 0), (1, 5), (0, 9), (4, 2)])
def test_other_majors_and_older_minors_are_refused_without_asking(release) -> None:
    with pytest.raises(Refusal) as refused:
        dropin.release_config_versions(release, never_asked)
    assert str(refused.value) == (f"containerd {release[0]}.{release[1]} is not one "
                                  f"podvm-node knows ({dropin.KNOWN}): nothing changed")


def test_the_install_doc_names_the_releases_the_code_takes() -> None:
    with open(dropin.__file__.rsplit("/", 2)[0] + "/docs/install.md") as f:
        doc = " ".join(f.read().split())
    assert ("a containerd other than 1.6, 1.7, 2.0-2.3 or a later 2.x whose `containerd "
            "config default` is version 3 or 4") in doc
    assert "2 for 1.x; 3 for 2.0-2.2; 3 or 4 for 2.3 and later" in doc
    assert max(dropin.SUPPORTED) == (2, 3) and dropin.LATER_VERSIONS == (3, 4)
    assert dropin.KNOWN == ("1.6, 1.7, 2.0-2.3, a later 2.x whose `containerd config "
                            "default` is version 3 or 4")


def test_the_default_config_comes_from_the_hosts_binary(tmp_path) -> None:
    """Debian's 1.6 on this machine: version 2; a host without containerd: None."""
    require_tool("containerd", "containerd")
    assert re.search(r"(?m)^version = 2$", hostcheck.containerd_default_config(""))
    assert hostcheck.containerd_default_config(str(tmp_path)) is None
