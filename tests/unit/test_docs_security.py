"""Every page that introduces the fleet's secret also says what it does not
protect: the KV blocks cross the network through NIXL/UCX unencrypted
(only the control plane and the NIXL metadata are sealed), and what to do
about it. A reader who stops at any one of these pages must not believe
the blocks are encrypted."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [
    "README.md",
    "docs/quickstart.md",
    "docs/two_hosts.md",
    "docs/configuration.md",
    "docs/recipes.md",
]


@pytest.mark.parametrize("page", PAGES)
def test_where_the_secret_is_introduced_the_blocks_are_said_to_be_unencrypted(
    page: str,
) -> None:
    text = " ".join((REPO / page).read_text().split())
    assert "P2P_KV_SECRET" in text, f"{page} no longer introduces the secret"
    said = re.search(r"KV blocks[^.]{0,80}unencrypted", text)
    assert said, f"{page}: says nothing of the KV blocks crossing unencrypted"
    assert "private" in text, f"{page}: does not say to keep the network private"
    assert "RDMA" in text, f"{page}: does not name RDMA isolation as the other way"


def test_no_page_claims_every_frame_or_the_data_is_encrypted() -> None:
    for page in PAGES:
        text = " ".join((REPO / page).read_text().split())
        assert "every frame after it is encrypted" not in text, page
        assert not re.search(r"blocks (are|travel) (encrypted|sealed)", text), page
