"""Preemption-notice pollers against a local server speaking the documented metadata formats."""

from __future__ import annotations

import threading

import pytest

from supervisor.monitor import Notice, NoticePoller, NoticeWatcher, poll_notice
from supervisor.monitor.notices import NoticeError, NoticeUnavailable
from tests.notice_servers import MetadataServer
from tests.servers import free_port


@pytest.fixture
def metadata():
    server = MetadataServer().start()
    try:
        yield server
    finally:
        server.stop()


def test_aws_imdsv2_token_then_instance_action(metadata):
    poller = NoticePoller("aws", metadata.url)
    assert poller.poll() is None  # 404: no interruption scheduled
    metadata.state.aws_action = {"action": "terminate", "time": "2017-09-18T08:22:00Z"}
    notice = poller.poll()
    assert notice == Notice(
        "aws", "terminate", "2017-09-18T08:22:00Z", {"action": "terminate", "time": "2017-09-18T08:22:00Z"}
    )
    puts = [r for r in metadata.state.requests if r[0] == "PUT"]
    assert len(puts) == 1 and puts[0][2]["X-aws-ec2-metadata-token-ttl-seconds"] == "21600"  # token reused
    gets = [r for r in metadata.state.requests if r[0] == "GET"]
    assert all(r[2]["X-aws-ec2-metadata-token"] == metadata.state.token for r in gets)
    poller.close()


def test_aws_falls_back_to_imdsv1(metadata):
    metadata.state.aws_tokens_enabled, metadata.state.aws_require_token = False, False
    metadata.state.aws_action = {"action": "stop", "time": "2026-11-21T10:02:00Z"}
    assert poll_notice("aws", metadata.url).action == "stop"


def test_gcp_preempted_flag(metadata):
    assert poll_notice("gcp", metadata.url) is None
    metadata.state.gcp_preempted = True
    assert poll_notice("gcp", metadata.url) == Notice("gcp", "preempted", None, {"preempted": True})
    assert all(r[2]["Metadata-Flavor"] == "Google" for r in metadata.state.requests)


def test_azure_scheduled_events(metadata):
    assert poll_notice("azure", metadata.url) is None
    freeze = {
        "EventId": "A1",
        "EventType": "Freeze",
        "ResourceType": "VirtualMachine",
        "Resources": ["vm1"],
        "EventStatus": "Scheduled",
        "NotBefore": "Mon, 19 Sep 2016 18:29:47 GMT",
    }
    metadata.state.azure_events = [freeze]
    assert poll_notice("azure", metadata.url) is None  # a freeze is not an eviction
    preempt = {
        **freeze,
        "EventId": "B2",
        "EventType": "Preempt",
        "NotBefore": "Mon, 19 Sep 2016 18:30:17 GMT",
    }
    metadata.state.azure_events = [freeze, preempt]
    notice = poll_notice("azure", metadata.url)
    assert (notice.provider, notice.action, notice.time) == (
        "azure",
        "preempt",
        "Mon, 19 Sep 2016 18:30:17 GMT",
    )
    assert notice.detail["EventId"] == "B2"
    assert all(r[2]["Metadata"] == "true" for r in metadata.state.requests)


def test_unreachable_endpoint_and_bad_answers_raise(metadata):
    with pytest.raises(NoticeUnavailable, match="ConnectionError"):
        poll_notice("gcp", f"http://127.0.0.1:{free_port()}", timeout=0.5)
    with pytest.raises(NoticeUnavailable, match="expected 200 or 404, got 401"):
        # A poller that sends no token to an IMDSv2-only host sees 401; that is not "no notice".
        metadata.state.aws_tokens_enabled = False
        poll_notice("aws", metadata.url)
    with pytest.raises(NoticeError, match="expected one of aws, gcp, azure, got 'oracle'"):
        poll_notice("oracle")


def test_notice_watcher_calls_back_once_per_notice(metadata):
    got: list[Notice] = []
    arrived = threading.Event()

    def on_notice(notice: Notice) -> None:
        got.append(notice)
        arrived.set()

    with NoticeWatcher("gcp", on_notice, endpoint=metadata.url, interval=0.02) as watcher:
        assert metadata.state.wait_requests(3)
        assert not arrived.is_set()
        metadata.state.gcp_preempted = True
        assert arrived.wait(10)
        seen = len(metadata.state.requests)
        assert metadata.state.wait_requests(seen + 5)  # still polling, still one callback
    assert got == [Notice("gcp", "preempted", None, {"preempted": True})] and watcher.notices == got
    after = len(metadata.state.requests)
    assert not metadata.state.wait_requests(after + 1, timeout=0.2)  # stopped means stopped


def test_notice_watcher_survives_a_failing_service(metadata):
    arrived = threading.Event()
    metadata.state.fail_with = 503
    with NoticeWatcher("gcp", lambda notice: arrived.set(), endpoint=metadata.url, interval=0.02):
        assert metadata.state.wait_requests(4)
        assert not arrived.is_set()
        metadata.state.gcp_preempted, metadata.state.fail_with = True, None
        assert arrived.wait(10)
