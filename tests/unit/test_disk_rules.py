"""The disk guard's pure core: the usage ledger and the aging rule, file by file."""

from __future__ import annotations

from agent.diskguard.rules import UsageLedger, choose_victims
from agent.fstree.paths import PathMap, Scopes, is_rank_name, is_record_name

T0 = 1_763_456_789  # a 10-digit Unix second


def ledger_of(*files: tuple[str, int, float]) -> UsageLedger:
    ledger = UsageLedger()
    for path, size, mtime in files:
        ledger.set(path, size, mtime)
    return ledger


def rank(path: str, count: int, size: int = 100, first_mtime: float = 0) -> list[tuple[str, int, float]]:
    """`count` record files in `path`, named and aged in the same order (file i has mtime first_mtime + i)."""
    return [(f"{path}/{T0 + i}", size, first_mtime + i) for i in range(count)]


def names(victims) -> list[str]:
    return [v.path for v in victims]


# ---- the ledger ---------------------------------------------------------------------------------


def test_ledger_tracks_sizes_and_the_total():
    ledger = UsageLedger()
    assert ledger.set("j/0/1700000000", 100, 1) is True
    assert ledger.set("j/0/1700000000", 250, 2) is False  # grew: replaced, not added
    assert ledger.set("j/1/parallel_group.json", 10, 1) is True
    assert ledger.set("top.txt", 5, 1) is True
    assert (ledger.total, len(ledger)) == (265, 3)
    assert ledger.get("j/0/1700000000").size == 250 and ledger.get("j/0/1700000000").mtime == 2
    assert ledger.remove("j/0/1700000000").size == 250
    assert ledger.remove("j/0/1700000000") is None and ledger.remove("nowhere/x") is None
    assert (ledger.total, len(ledger)) == (15, 2)
    assert ledger.sizes() == {"j/1/parallel_group.json": 10, "top.txt": 5}
    assert sorted(ledger.dirs()) == ["", "j/1"]


def test_remove_tree_drops_a_prefix_and_only_that_prefix():
    ledger = ledger_of(("job1/0/a", 1, 0), ("job1/1/b", 2, 0), ("job1/c", 4, 0), ("job10/0/d", 8, 0),
                       ("job1x", 16, 0), ("job1", 32, 0))
    # "job1" is also a file name here, which a directory cannot be at the same time; the ledger does not care.
    assert ledger.remove_tree("job1") == 4
    assert ledger.sizes() == {"job10/0/d": 8, "job1x": 16}
    assert ledger.total == 24
    assert ledger.remove_tree("job10/0") == 1 and ledger.total == 16
    assert ledger.remove_tree("") == 1 and (ledger.total, len(ledger)) == (0, 0)


def test_remove_trees_drops_many_prefixes():
    ledger = ledger_of(*((f"job/{r}/{name}", 1, 0) for r in range(3000) for name in ("a", "b")), ("job/30x", 2, 0),
                       ("other/3/c", 4, 0))
    assert ledger.remove_trees(f"job/{r}" for r in range(0, 3000, 2)) == 3000
    assert len(ledger) == 3002 and not any(ledger.files_in(f"job/{r}") for r in range(0, 3000, 2))
    assert ledger.files_in("job/31") and ledger.get("job/30x") and ledger.get("other/3/c")
    assert ledger.remove_trees(["job/30x", "other"]) == 2 and len(ledger) == 3000


def test_scopes_hold_a_path_when_it_is_one_of_them_or_below_one():
    scopes = Scopes(["job", "job/1", "x/y"])
    assert scopes.holding("job/1/a") == ["job", "job/1"]
    assert scopes.holding("job10/1") == [] and scopes.holding("x/yz") == [] and scopes.holding("x") == []
    assert scopes.holding("x/y") == ["x/y"] and Scopes([""]).holding("any/thing") == [""]


def test_a_path_map_lists_and_drops_a_subtree_and_only_that_subtree():
    paths = PathMap()
    for path in ("job/1", "job/1/a", "job/10", "job1", "job", "x/y/z", ""):
        paths[path] = path.upper()
    assert paths.under("job") == [("job", "JOB"), ("job/1", "JOB/1"), ("job/1/a", "JOB/1/A"), ("job/10", "JOB/10")]
    assert paths.under("x") == [("x/y/z", "X/Y/Z")] and paths.under("x/y/z/w") == [] and paths.under("jo") == []
    assert paths.pop_tree("job/1") == [("job/1", "JOB/1"), ("job/1/a", "JOB/1/A")]
    assert paths.pop("job") == "JOB" and paths.pop("job") is None
    assert sorted(paths) == ["", "job/10", "job1", "x/y/z"] and paths.get("job/10") == "JOB/10"
    assert paths.under("job") == [("job/10", "JOB/10")]  # still reached through a path that holds nothing
    del paths["x/y/z"]
    paths["x/y"] = "again"
    assert paths.under("x") == [("x/y", "again")]
    assert [path for path, _ in paths.pop_tree("")] == ["", "job/10", "job1", "x/y"] and len(paths) == 0
    assert paths.under("") == []


def test_a_path_map_forgets_a_large_subtree_directory_by_directory_as_events_come():
    # rm -rf of a job: each rank directory goes on its own, deepest first, then the job; the rest stays.
    paths = PathMap()
    for job in ("a", "b"):
        for rank in range(20_000):
            paths[f"{job}/{rank}"] = rank
    for rank in reversed(range(20_000)):
        assert paths.pop_tree(f"a/{rank}") == [(f"a/{rank}", rank)]
    assert paths.pop_tree("a") == [] and len(paths) == 20_000 and len(paths.under("b")) == 20_000


def test_rank_names_are_canonical_decimal_numbers():
    assert all(is_rank_name(name) for name in ("0", "7", "15", "999999999"))
    for name in ("01", "-1", "+1", "1.0", "1000000000", "", " 1", "١", "a"):
        assert not is_rank_name(name), name


def test_record_names_are_exactly_ten_ascii_digits():
    assert is_record_name("1763456789")
    assert is_record_name("0000000000")
    for name in ("176345678", "17634567890", "1763456789.tmp", "parallel_group.json", " 1763456789",
                 "1763456789\n", "١٧٦٣٤٥٦٧٨٩", "176345678\u00b2", ""):
        assert not is_record_name(name), name


# ---- the aging rule -----------------------------------------------------------------------------


def test_nothing_is_chosen_at_or_under_the_limit_or_when_aging_is_disabled():
    ledger = ledger_of(*rank("j/0", 10))
    assert choose_victims(ledger, 1000) == []  # usage == limit is not over it
    assert choose_victims(ledger, 5000) == []
    assert choose_victims(ledger, 0) == []  # 0 (or less): aging disabled
    assert choose_victims(ledger, -1) == []


def test_one_round_takes_the_oldest_fifth_of_every_rank_by_mtime():
    # Names deliberately out of mtime order (except the newest): the rule goes by mtime.
    r0 = [("j/0/1700000005", 100, 1), ("j/0/1700000001", 100, 2), ("j/0/1700000009", 100, 3),
          ("j/0/1700000002", 100, 4), ("j/0/1700000007", 100, 5), ("j/0/1700000003", 100, 6),
          ("j/0/1700000004", 100, 7), ("j/0/1700000008", 100, 8), ("j/0/1700000000", 100, 9),
          ("j/0/1700000010", 100, 10)]
    r1 = rank("j/1", 25, first_mtime=100)
    r2 = rank("k/7", 4, first_mtime=200)
    ledger = ledger_of(*r0, *r1, *r2)  # 39 files, 3900 bytes
    victims = choose_victims(ledger, 3899)  # one byte over: still a whole round
    assert names(victims) == [
        "j/0/1700000005", "j/0/1700000001",  # floor(10/5) = 2 oldest by mtime
        *[f"j/1/{T0 + i}" for i in range(5)],  # floor(25/5) = 5
        f"k/7/{T0}",  # 4 files: floor is 0, so the single oldest (the newest stays)
    ]


def test_the_newest_record_file_of_a_rank_always_stays():
    ledger = ledger_of(*rank("j/0", 2), *rank("j/1", 1, first_mtime=10))
    assert names(choose_victims(ledger, 1)) == [f"j/0/{T0}"]  # j/1's only file is its newest


def test_the_file_the_writer_appends_to_stays_even_when_its_mtime_is_old():
    # TaskD appends to the largest name. Someone set that file's mtime back (touch -d): it is the
    # oldest by mtime, yet it is the rank's open file, so it stays, as does the newest by mtime.
    files = rank("j/0", 5, first_mtime=10) + [("j/0/1799999999", 100, 1)]
    ledger = ledger_of(*files)
    victims = choose_victims(ledger, 1)
    assert "j/0/1799999999" not in names(victims)
    assert f"j/0/{T0 + 4}" not in names(victims)  # newest by mtime
    assert sorted(names(victims)) == sorted(f"j/0/{T0 + i}" for i in range(4))
    # Two files, one the largest name, the other the newest: neither may go.
    ledger = ledger_of(("j/0/1799999999", 100, 1), ("j/0/1700000000", 100, 2))
    assert choose_victims(ledger, 1) == []


def test_equal_mtimes_age_by_name():
    ledger = ledger_of(*[(f"j/0/{T0 + i}", 100, 5) for i in (3, 1, 4, 0, 2, 9, 8, 7, 6, 5)])
    assert names(choose_victims(ledger, 999)) == [f"j/0/{T0}", f"j/0/{T0 + 1}"]


def test_other_names_are_never_chosen_nor_counted():
    others = [("j/0/parallel_group.json", 5000, 0), ("j/0/176345678", 5000, 0), ("j/0/17634567890", 5000, 0),
              ("j/0/1763456789.tmp", 5000, 0), ("j/0/notes", 5000, 0), ("j/0/١٧٦٣٤٥٦٧٨٩", 5000, 0)]
    ledger = ledger_of(*others, *rank("j/0", 9, first_mtime=1))
    # 9 record files: floor(9/5) = 1 per round; the other names (older, bigger) would make it 3 if counted.
    victims = choose_victims(ledger, ledger.total - 1)
    assert names(victims) == [f"j/0/{T0}"]
    # Far over the limit, rounds continue until only the newest record file is left; the rest stays.
    victims = choose_victims(ledger, 1)
    assert sorted(names(victims)) == sorted(f"j/0/{T0 + i}" for i in range(8))
    assert not {p for p, _, _ in others} & set(names(victims))


def test_only_files_exactly_at_job_rank_file_are_chosen():
    ledger = ledger_of(
        *rank("j/0", 5),
        *[(f"{T0 + i}", 1000, 0) for i in range(5)],  # in the root
        *[(f"j/{T0 + i}", 1000, 0) for i in range(5)],  # in a job directory
        *[(f"j/0/sub/{T0 + i}", 1000, 0) for i in range(5)],  # below a rank directory
        *[(f"j/0/sub/deeper/{T0 + i}", 1000, 0) for i in range(5)],
    )
    victims = choose_victims(ledger, 1)
    # Only j/0's own 5 record files count (not sub/'s): rounds of 1 until its newest alone is left.
    assert names(victims) == [f"j/0/{T0 + i}" for i in range(4)]


def test_rounds_repeat_recounting_until_under_the_limit():
    ledger = ledger_of(*rank("j/0", 10, size=10), *rank("j/1", 12, size=1, first_mtime=100))  # 112 bytes
    # Round 1: j/0 loses 2 (20 bytes), j/1 loses 2 (2 bytes): 90 left, still over 80.
    # Round 2, recounted: j/0 has 8 -> 1 (10 bytes), j/1 has 10 -> 2 (2 bytes): 78 <= 80, stop.
    victims = choose_victims(ledger, 80)
    assert names(victims) == [f"j/0/{T0}", f"j/0/{T0 + 1}", f"j/1/{T0}", f"j/1/{T0 + 1}",
                              f"j/0/{T0 + 2}", f"j/1/{T0 + 2}", f"j/1/{T0 + 3}"]
    assert ledger.total - sum(v.size for v in victims) == 78
    # The ledger itself is not changed: choosing is pure.
    assert ledger.total == 112 and len(ledger) == 22


def test_a_round_is_finished_even_when_the_first_rank_already_frees_enough():
    ledger = ledger_of(*rank("a/0", 5, size=1000), *rank("b/0", 5, size=1, first_mtime=10))
    victims = choose_victims(ledger, ledger.total - 1)
    assert names(victims) == [f"a/0/{T0}", f"b/0/{T0}"]  # b/0 is not spared for coming second


def test_nothing_deletable_stops_and_stays_over_the_limit():
    ledger = ledger_of(*rank("j/0", 3), *rank("j/1", 1, first_mtime=10), ("j/0/parallel_group.json", 10**6, 0),
                       ("big.bin", 10**6, 0))
    victims = choose_victims(ledger, 1000)
    assert names(victims) == [f"j/0/{T0}", f"j/0/{T0 + 1}"]  # rounds of one until the newest is alone
    ledger = ledger_of(("j/0/parallel_group.json", 10**6, 0), (f"j/0/{T0}", 10, 0))
    assert choose_victims(ledger, 1) == []


def test_many_ranks_many_rounds_keep_one_file_each():
    files = []
    for job in range(3):
        for r in range(4):
            files += rank(f"job{job}/{r}", 7 + r, first_mtime=job * 100 + r * 10)
    ledger = ledger_of(*files)
    victims = choose_victims(ledger, 1)
    kept = set(ledger.sizes()) - set(names(victims))
    assert kept == {f"job{job}/{r}/{T0 + 6 + r}" for job in range(3) for r in range(4)}
    assert len(set(names(victims))) == len(victims)  # no file chosen twice
