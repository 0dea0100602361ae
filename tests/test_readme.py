"""README.md's chapter table: each "blog" link is the series' page of its row's chapter."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = re.compile(r"https://le\.qun\.ch/en/blog/2024/12/\d\d/libfabric-efa-(\d+)-")
UNSEEN = {7}  # no stored copy of the series gives this page's address, and slugs are not guessed


def chapter_rows():
    text = (ROOT / "README.md").read_text()
    return {int(m[1]): m[0] for m in re.finditer(r"^\| (\d\d) \|.*$", text, re.MULTILINE)}


def test_each_blog_link_is_its_rows_chapter():
    for chapter, row in chapter_rows().items():
        assert all(int(n) == chapter for n in PAGE.findall(row)), row


def test_every_chapter_of_the_series_links_its_page():
    linked = {chapter for chapter, row in chapter_rows().items() if PAGE.search(row)}
    assert linked == set(range(3, 16)) - UNSEEN
