"""What the tailer's walks of the profiling tree note (in the worker thread): job and rank
directories, each rank's record files and whether it has a parallel_group.json.

A job directory whose name is not UTF-8 (a job's UID is ASCII; such a name cannot be a label) and a
rank directory whose name is not a canonical number are reported once (`job_dir`, `rank_dir`) and
not followed. Nothing below a rank directory is walked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from agent.fstree.paths import is_rank_name, is_record_name, join
from agent.fstree.walk import Walk
from agent.steps.cursors import RankSeen
from agent.steps.reader import GROUP_FILE, line_end


@dataclass
class TailWalk(Walk):
    want_ends: bool = False  # find where the last complete line of each rank's newest file ends
    ranks: list[RankSeen] = field(default_factory=list)
    bad_dirs: list[str] = field(default_factory=list)  # job or rank directories not followed


def depth(directory: str) -> int:
    """0 for the root, 1 for a job directory, 2 for a rank directory."""
    return directory.count("/") + 1 if directory else 0


def is_dir_name(depth: int, name: str) -> bool:
    """A job directory's name (depth 0 lists jobs) must be UTF-8, as a job's UID is, to be a label;
    a rank directory's (depth 1) a canonical number."""
    if depth == 1:
        return is_rank_name(name)
    try:
        name.encode()  # a name that is not UTF-8 comes from os.listdir as lone surrogates
    except UnicodeEncodeError:
        return False
    return True


def list_dir(fd: int, directory: str, out: TailWalk) -> list[str]:
    """A rank directory's files; above the ranks, the subdirectories to walk."""
    level = depth(directory)
    if level == 2:
        out.ranks.append(_list_rank(fd, directory, out))
        return []
    with os.scandir(fd) as entries:
        children = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
    out.bad_dirs.extend(join(directory, name) for name in children if not is_dir_name(level, name))
    return [name for name in children if is_dir_name(level, name)]


def _list_rank(fd: int, directory: str, out: TailWalk) -> RankSeen:
    found = RankSeen(directory, os.fstat(fd).st_ino)
    with os.scandir(fd) as entries:
        for entry in entries:
            name = entry.name
            if not (name == GROUP_FILE or is_record_name(name)):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue  # symlinks, directories, FIFOs: never followed
                size = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # deleted since it was listed
            except OSError as exc:
                out.problems.append(("cannot stat a file", f"{directory}/{name}", str(exc)))
                continue
            if name == GROUP_FILE:
                found.group = True
            else:
                found.files[name] = size
    if out.want_ends and found.files:
        found.end = line_end(fd, max(found.files))
    return found
