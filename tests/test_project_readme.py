"""README.md: each "blog" link of the chapter table is the series' page of its row's chapter;
its map points to scripts/README.md, where every script has a row with its usual command."""
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


def script_rows():
    """{script named in the first cell of a row of scripts/README.md: its usual command}."""
    text = (ROOT / "scripts" / "README.md").read_text()
    return {m[1]: m[2] for m in re.finditer(r"^\| \[`([\w.]+)`\]\(\1\) \|.*\| `([^`]+)` \|$",
                                            text, re.MULTILINE)}


def test_every_script_has_a_row_whose_command_runs_it():
    rows = script_rows()
    scripts = {p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh")}
    assert sorted(scripts - set(rows)) == []
    assert [name for name in scripts if f"scripts/{name}" not in rows[name]] == []


def test_the_map_points_to_the_scripts_table():
    layout = (ROOT / "README.md").read_text().split("## Layout", 1)[1]
    assert re.search(r"^scripts/ .*\n(?: .*\n)*? .*scripts/README\.md", layout, re.MULTILINE)
