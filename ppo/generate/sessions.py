"""Rows of a rollout by prompt group and by session.

A prompt's group is n sampled responses (--n-samples-per-prompt). Usually each is one row, but
a generate function may return several samples for one response: an agent session whose chat
template rewrote history leaves one record per rewrite, and every record trains
(docs/agents.md). Those rows are one *session*: consecutive, with the same "group_index" and
"session" (the request index they were generated for), sharing one reward. Code that counts
a group's members counts sessions; code that cuts the batch into groups cuts by "group_index".
"""

from __future__ import annotations


def session_key(sample: dict) -> tuple[int, int]:
    """Which session a row belongs to: rows without "session" (one row per response) are their own."""
    return sample["group_index"], sample.get("session", sample["index"])


def session_ordinals(samples: list[dict]) -> list[int]:
    """Each row's session as 0, 1, ... in batch order; ValueError if a session's rows are apart."""
    out, seen, last = [], set(), None
    for s in samples:
        key = session_key(s)
        if key != last:
            if key in seen:
                raise ValueError(f"the rows of session {key} (group_index, session) are not consecutive")
            seen.add(key)
            last = key
        out.append(len(seen) - 1)
    return out


def by_group(samples: list[dict]) -> list[list[dict]]:
    """The batch cut into its prompt groups (consecutive rows of one "group_index"), in order."""
    groups: list[list[dict]] = []
    for s in samples:
        if groups and groups[-1][0]["group_index"] == s["group_index"]:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


def session_ends(samples: list[dict]) -> list[dict]:
    """One row per session, its last: the one a generate function returned last (an agent's
    latest record), e.g. for eval metrics that count responses."""
    return [s for i, s in enumerate(samples) if i + 1 == len(samples) or session_key(samples[i + 1]) != session_key(s)]


def renumber(groups: list[list[dict]]) -> list[dict]:
    """The groups as one batch: "group_index" their place, "index" each row's; a row's "session"
    is kept (it tells the rows of one session apart from the next within the group)."""
    rows = [dict(s, group_index=g) for g, group in enumerate(groups) for s in group]
    for i, s in enumerate(rows):
        s["index"] = i
    return rows
