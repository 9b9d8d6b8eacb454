"""Edit-style prompts: a function of 15-30 lines and a small change to make. The answer copies most of the prompt,
which is what draft.kind=hybrid's prompt lookup is for (`bench/run_bench.py --prompt-set edit --hybrid`)."""
from __future__ import annotations

ASK = ("Rewrite this function with one small change: {change}. Keep everything else exactly as it is. Reply with the "
       "whole function in a Python code block and nothing else.\n\n```python\n{code}```")

FUNCTIONS = [
    ("rename the parameter `items` to `records` everywhere", '''def summarize_orders(items, currency="EUR"):
    """Totals per customer and the largest single order."""
    totals = {}
    largest = None
    for order in items:
        customer = order["customer"]
        amount = order["amount"]
        if order.get("currency", currency) != currency:
            raise ValueError(f"order {order['id']} is not in {currency}")
        totals[customer] = totals.get(customer, 0) + amount
        if largest is None or amount > largest["amount"]:
            largest = order
    ranked = sorted(totals.items(), key=lambda kv: kv[1], reverse=True)
    return {
        "currency": currency,
        "customers": len(totals),
        "totals": dict(ranked),
        "largest": largest,
        "count": len(items),
    }
'''),
    ("make the retry delay grow by a factor of 3 instead of 2", '''import time


def fetch_with_retries(client, url, attempts=5, delay=0.5, timeout=10.0):
    """GET `url`, retrying on connection errors and 5xx answers with a growing delay."""
    last_error = None
    for attempt in range(1, attempts + 1):
        try:
            response = client.get(url, timeout=timeout)
        except ConnectionError as error:
            last_error = error
        else:
            if response.status_code < 500:
                response.raise_for_status()
                return response.json()
            last_error = RuntimeError(f"{url}: server error {response.status_code}")
        if attempt < attempts:
            time.sleep(delay)
            delay *= 2
    raise RuntimeError(f"{url}: gave up after {attempts} attempts") from last_error
'''),
    ("skip lines that start with '#' as comments", '''def parse_config(text):
    """KEY=VALUE lines into a dict; values that look like numbers or booleans are converted."""
    config = {}
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line:
            continue
        if "=" not in line:
            raise ValueError(f"line {number}: expected KEY=VALUE, got {line!r}")
        key, value = (part.strip() for part in line.split("=", 1))
        if not key.isidentifier():
            raise ValueError(f"line {number}: {key!r} is not a valid key")
        if value.lower() in ("true", "false"):
            config[key] = value.lower() == "true"
        elif value.isdigit():
            config[key] = int(value)
        else:
            try:
                config[key] = float(value)
            except ValueError:
                config[key] = value
    return config
'''),
    ("return the path as a list of nodes instead of its length", '''from collections import deque


def shortest_path(graph, start, goal):
    """Breadth-first search over an adjacency dict; the number of edges from start to goal, or -1."""
    if start == goal:
        return 0
    seen = {start}
    queue = deque([(start, 0)])
    while queue:
        node, distance = queue.popleft()
        for neighbour in graph.get(node, ()):
            if neighbour in seen:
                continue
            if neighbour == goal:
                return distance + 1
            seen.add(neighbour)
            queue.append((neighbour, distance + 1))
    return -1
'''),
    ("add a `min_count` parameter (default 1) and leave out words seen fewer times", '''import re
from collections import Counter


def word_frequencies(text, top=10, stop_words=frozenset()):
    """The `top` most common words of `text`, lower-cased, as (word, count, share) tuples."""
    words = re.findall(r"[a-z']+", text.lower())
    words = [w.strip("'") for w in words]
    words = [w for w in words if w and w not in stop_words]
    counts = Counter(words)
    total = sum(counts.values())
    if total == 0:
        return []
    result = []
    for word, count in counts.most_common(top):
        share = count / total
        result.append((word, count, round(share, 4)))
    return result
'''),
    ("make the cache evict the least recently used entry instead of the oldest one", '''from collections import OrderedDict


class BoundedCache:
    """A dict-like cache holding at most `capacity` entries; the oldest entry goes first."""

    def __init__(self, capacity=128):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.entries = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key, default=None):
        if key in self.entries:
            self.hits += 1
            return self.entries[key]
        self.misses += 1
        return default

    def put(self, key, value):
        self.entries[key] = value
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
'''),
    ("raise a ValueError when the matrix is not square", '''def matrix_stats(matrix):
    """Row sums, column sums, the trace and the largest entry of a list-of-lists matrix."""
    if not matrix or not matrix[0]:
        raise ValueError("empty matrix")
    width = len(matrix[0])
    for index, row in enumerate(matrix):
        if len(row) != width:
            raise ValueError(f"row {index} has {len(row)} entries, expected {width}")
    row_sums = [sum(row) for row in matrix]
    column_sums = [sum(row[j] for row in matrix) for j in range(width)]
    trace = sum(matrix[i][i] for i in range(min(len(matrix), width)))
    largest = max(max(row) for row in matrix)
    position = next((i, row.index(largest)) for i, row in enumerate(matrix) if largest in row)
    return {
        "rows": row_sums,
        "columns": column_sums,
        "trace": trace,
        "largest": largest,
        "largest_at": position,
    }
'''),
    ("log a warning with the logging module instead of printing it", '''import csv


def load_scores(path, required=("name", "score")):
    """Read a CSV of scores; rows with a missing field or a score that is not a number are skipped."""
    scores = {}
    skipped = 0
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [field for field in required if field not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}")
        for line, row in enumerate(reader, start=2):
            name = (row.get("name") or "").strip()
            try:
                score = float(row.get("score", ""))
            except ValueError:
                score = None
            if not name or score is None:
                print(f"warning: {path}:{line}: skipped {row}")
                skipped += 1
                continue
            scores[name] = max(score, scores.get(name, score))
    return scores, skipped
'''),
]

EDIT_PROMPTS = [ASK.format(change=change, code=code) for change, code in FUNCTIONS]
