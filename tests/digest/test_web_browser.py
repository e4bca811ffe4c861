"""The web view in headless Chromium, as a reader uses it: a real `digest serve` on a free
loopback port over a store the test fills; type a query into the search box, read the results,
follow a result to the paper's entry in its digest page, filter by category.

Debian's chromium (/usr/bin/chromium) driven by playwright; no browser is ever downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.digest.web_view_server import digest_serve, fill_store

CHROMIUM = Path("/usr/bin/chromium")

pytestmark = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="no chromium binary at /usr/bin/chromium (apt-get install -y chromium)",
)


@pytest.fixture
def page(tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True)
        try:
            context = browser.new_context(java_script_enabled=False)  # the view needs none
            yield context.new_page()
        finally:
            browser.close()


def test_search_box_results_and_entry_link(page, sqlite_url, tmp_path):
    fill_store(sqlite_url).engine.dispose()
    with digest_serve(sqlite_url) as server:
        page.goto(server.url)
        assert page.title() == "Nightshift paper digests"
        page.get_by_role("searchbox", name="Search words").fill('"knowledge graphs" retrieval')
        page.get_by_role("button", name="Search").click()
        page.wait_for_url("**/search?*")
        hits = page.locator("ol.hits > li")
        assert hits.count() == 1
        assert page.locator("p.count").inner_text().startswith("1 paper")
        assert page.locator("ol.hits mark").first.inner_text().lower() in ("knowledge", "retrieval")
        page.screenshot(path=str(tmp_path / "search.png"))
        # Follow the result to the paper's entry in the digest page of its date.
        hits.first.locator("a.entry").click()
        page.wait_for_url("**/digest-2026-03-10.html#2603.00003")
        entry = page.locator('article[id="2603.00003"]')
        assert entry.is_visible() and "Retrieval over knowledge graphs" in entry.inner_text()
        assert page.title() == "Paper digest 2026-03-10"
        # Back to the index, then the category filter from a result's category link.
        page.get_by_role("link", name="All digests").click()
        page.locator("select[name=category]").select_option("cs.LG")
        page.get_by_role("button", name="Search").click()
        page.wait_for_url("**category=cs.LG*")
        titles = page.locator("ol.hits h3").all_inner_texts()
        assert titles == ["Tokenisers for <b>code</b> & math"]  # shown as typed, not as HTML
        # Garbage typed into the box: a 400 page that says why, with the box to try again.
        page.goto(server.url)
        page.get_by_role("searchbox", name="Search words").fill('"*"')
        response_waiter = page.expect_response(lambda r: "/search" in r.url)
        with response_waiter as info:
            page.get_by_role("button", name="Search").click()
        assert info.value.status == 400
        assert "nothing to search for" in page.get_by_role("alert").inner_text()
        assert page.get_by_role("searchbox", name="Search words").is_visible()
