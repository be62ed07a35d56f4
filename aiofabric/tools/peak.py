"""perftest's BW peak and average (its print_report_bw), from when each work request of a run was posted and when each
signaled completion came back, counted over all the run's QPs in one sequence as perftest counts them (tposted[],
tcompleted[]).

The average is every message over the time from the first post to the last completion. The peak is the fastest
stretch of consecutive messages: the least (completion of message j - post of message i) / (j - i + 1) over every
post i and every signaled completion j >= i. perftest tries every pair; here the posts are points (index, time) and
for each completion the best post lies on their upper convex hull, found by binary search, so a run of n messages
costs O(n log n) instead of O(n^2).
"""
from __future__ import annotations

Point = tuple[float, float]


class Timeline:
    """The posts and signaled completions of a run, numbered across its QPs: `post(count, when)` records `count`
    work requests posted at `when` (one call, one time), `complete(count, when)` a completion that ends `count`
    more of them."""

    def __init__(self) -> None:
        self.posted = self.completed = 0
        self.posts: list[Point] = []  # (index of the first work request of a post, its time)
        self.completions: list[Point] = []  # (index of the last work request a completion ends, its time)

    def post(self, count: int, when: float) -> None:
        self.posts.append((self.posted, when))
        self.posted += count

    def complete(self, count: int, when: float) -> None:
        self.completed += count
        self.completions.append((self.completed - 1, when))

    def span(self) -> float:
        """Seconds from the first post to the last completion (0 before either)."""
        return self.completions[-1][1] - self.posts[0][1] if self.posts and self.completions else 0.0

    def fastest(self) -> float:
        """perftest's least seconds per message over a stretch of consecutive messages (0 when nothing completed)."""
        return fastest(self.posts, self.completions)


def _cross(o: Point, a: Point, b: Point) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def fastest(posts: list[Point], completions: list[Point]) -> float:
    """min over posts (i, t_i) and completions (j, c_j) with i <= j of (c_j - t_i) / (j - i + 1), both lists in
    increasing index. A completion is the point q = (j + 1, c_j), and (c_j - t_i) / (j + 1 - i) is the slope from
    post (i, t_i) to q: the least slope from q to points left of it is to a vertex of their upper hull, and along the
    hull the slope to q falls and then rises, so a binary search finds it."""
    hull: list[Point] = []
    best: float | None = None
    k = 0
    for index, when in completions:
        while k < len(posts) and posts[k][0] <= index:
            point = posts[k]
            while len(hull) >= 2 and _cross(hull[-2], hull[-1], point) >= 0:
                hull.pop()
            hull.append(point)
            k += 1
        if not hull:
            continue
        qx, qy = index + 1, when
        low, high = 0, len(hull) - 1  # the first vertex whose successor's slope to q is no smaller
        while low < high:
            middle = (low + high) // 2
            (x0, y0), (x1, y1) = hull[middle], hull[middle + 1]
            if (qy - y1) * (qx - x0) >= (qy - y0) * (qx - x1):
                high = middle
            else:
                low = middle + 1
        x, y = hull[low]
        slope = (qy - y) / (qx - x)
        best = slope if best is None else min(best, slope)
    return best or 0.0
