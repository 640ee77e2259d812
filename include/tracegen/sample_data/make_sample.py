"""Generate the bundled demo dataset: agentic-coding prompts from hand-written templates.

Every template and snippet here was written for tracegen. Rows are drawn deterministically
(one `random.Random(seed)`), written as a multi-member gzip with mtime 0, so the file is
byte-for-byte reproducible and seekable in place (`dataset_index` needs no copy). The file is
kept clean: malformed rows live in the tests, not in the demo data.

    python -m tracegen.sample_data.make_sample [--rows 3000] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tracegen.dataset.index import write_multimember_gzip
from tracegen.sample_data import SAMPLE_DATASET, SAMPLE_ROWS

SEED = 20240913
ROWS_PER_MEMBER = 32

# ------------------------------------------------------------------ vocabulary

PROJECTS = [
    "billing-service", "ingest-worker", "cartographer", "ledgerd", "pixel-pipeline", "authgate",
    "notifier", "search-indexer", "fleet-agent", "invoice-api", "telemetry-sink", "docs-site",
    "payments-core", "feature-flags", "scheduler", "chat-backend", "etl-jobs", "mobile-bff",
]
ENTITIES = ["invoice", "user", "order", "session", "shipment", "report", "subscription", "device", "ticket", "job"]
SYSTEM_PROMPTS = [
    "You are a senior software engineer. Answer with working code and explain the key decisions briefly.",
    "You are a coding assistant inside the user's terminal. Prefer minimal, reviewable changes.",
    "You are an expert pair programmer. Think step by step, then give the final patch.",
    "You are a careful code reviewer. Point out correctness problems before style.",
    "You are an autonomous software agent. Use the tools to inspect the repository before editing. "
    "Never run destructive commands without being asked. When the task is done, summarise what changed.",
    "You help engineers debug production incidents. Be precise about root causes and say what you are unsure of.",
]

# Per language: a few snippets with a deliberate bug or smell, an error trace, and test tooling.
LANGS: dict[str, dict[str, Any]] = {
    "python": {
        "ext": "py",
        "test": "pytest",
        "snippets": [
            '''def paginate(items, page, per_page=20):
    start = page * per_page
    end = start + per_page
    return items[start:end], len(items) // per_page''',
            '''class RateLimiter:
    def __init__(self, rate, per):
        self.rate = rate
        self.per = per
        self.allowance = rate
        self.last = time.time()

    def allow(self):
        now = time.time()
        self.allowance += (now - self.last) * (self.rate / self.per)
        if self.allowance > self.rate:
            self.allowance = self.rate
        if self.allowance < 1:
            return False
        self.allowance -= 1
        return True''',
            '''def load_config(path):
    with open(path) as f:
        cfg = json.load(f)
    for key, default in DEFAULTS.items():
        cfg.setdefault(key, default)
    cfg["retries"] = int(cfg["retries"])
    return cfg''',
            '''async def fetch_all(session, urls):
    results = []
    for url in urls:
        async with session.get(url) as resp:
            results.append(await resp.json())
    return results''',
            '''def merge_intervals(intervals):
    intervals.sort()
    merged = [intervals[0]]
    for start, end in intervals[1:]:
        if start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
        ],
        "errors": [
            ("KeyError: 'retries'", "load_config", "config.py"),
            ("TypeError: 'NoneType' object is not subscriptable", "handle_{entity}", "handlers.py"),
            ("IndexError: list index out of range", "merge_intervals", "intervals.py"),
            ("RuntimeError: Event loop is closed", "fetch_all", "client.py"),
            ("sqlalchemy.exc.IntegrityError: duplicate key value violates unique constraint \"{entity}s_pkey\"",
             "save_{entity}", "repository.py"),
        ],
    },
    "typescript": {
        "ext": "ts",
        "test": "vitest",
        "snippets": [
            '''export function debounce<T extends (...args: any[]) => void>(fn: T, ms: number) {
  let timer: ReturnType<typeof setTimeout>;
  return (...args: Parameters<T>) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}''',
            '''export async function getUser(id: string): Promise<User> {
  const res = await fetch(`/api/users/${id}`);
  const body = await res.json();
  return body.data as User;
}''',
            '''export function groupBy<T>(xs: T[], key: (x: T) => string): Record<string, T[]> {
  return xs.reduce((acc, x) => {
    (acc[key(x)] ||= []).push(x);
    return acc;
  }, {} as Record<string, T[]>);
}''',
            '''const cache = new Map<string, Promise<Response>>();
export function cachedFetch(url: string) {
  if (!cache.has(url)) cache.set(url, fetch(url));
  return cache.get(url)!;
}''',
        ],
        "errors": [
            ("TypeError: Cannot read properties of undefined (reading 'map')", "render{Entity}List",
             "components/{Entity}List.tsx"),
            ("Error: Hydration failed because the initial UI does not match what was rendered on the server",
             "Page", "app/{entity}/page.tsx"),
            ("TypeError: body.data is undefined", "getUser", "api/users.ts"),
            ("UnhandledPromiseRejection: TypeError: Body is unusable: Body has already been read",
             "cachedFetch", "lib/cache.ts"),
        ],
    },
    "go": {
        "ext": "go",
        "test": "go test",
        "snippets": [
            '''func (s *Store) Get(key string) (string, bool) {
	s.mu.RLock()
	v, ok := s.data[key]
	s.mu.RUnlock()
	if !ok {
		s.mu.Lock()
		s.data[key] = s.loader(key)
		s.mu.Unlock()
	}
	return v, ok
}''',
            '''func worker(ctx context.Context, jobs <-chan Job, results chan<- Result) {
	for j := range jobs {
		res, err := process(ctx, j)
		if err != nil {
			log.Printf("job %d failed: %v", j.ID, err)
			continue
		}
		results <- res
	}
}''',
            '''func ParseDuration(s string) (time.Duration, error) {
	if strings.HasSuffix(s, "d") {
		days, err := strconv.Atoi(strings.TrimSuffix(s, "d"))
		if err != nil {
			return 0, err
		}
		return time.Duration(days) * 24 * time.Hour, nil
	}
	return time.ParseDuration(s)
}''',
        ],
        "errors": [
            ("panic: assignment to entry in nil map", "NewStore", "store/store.go"),
            ("fatal error: concurrent map writes", "(*Store).Get", "store/store.go"),
            ("panic: runtime error: invalid memory address or nil pointer dereference", "(*{Entity}Handler).ServeHTTP",
             "http/{entity}.go"),
            ("panic: send on closed channel", "worker", "pool/worker.go"),
        ],
    },
    "rust": {
        "ext": "rs",
        "test": "cargo test",
        "snippets": [
            '''pub fn parse_header(line: &str) -> (String, String) {
    let mut parts = line.splitn(2, ':');
    let name = parts.next().unwrap().trim().to_lowercase();
    let value = parts.next().unwrap().trim().to_string();
    (name, value)
}''',
            '''impl Cache {
    pub fn get_or_insert(&mut self, key: &str) -> &Entry {
        if let Some(e) = self.map.get(key) {
            return e;
        }
        self.map.insert(key.to_string(), Entry::load(key));
        self.map.get(key).unwrap()
    }
}''',
            '''pub async fn handle(req: Request<Body>, db: Arc<Mutex<Db>>) -> Result<Response<Body>> {
    let guard = db.lock().unwrap();
    let rows = guard.query(req.uri().path()).await?;
    Ok(Response::new(Body::from(serde_json::to_vec(&rows)?)))
}''',
        ],
        "errors": [
            ("thread 'main' panicked at 'called `Option::unwrap()` on a `None` value'", "parse_header",
             "src/http/header.rs"),
            ("error[E0502]: cannot borrow `self.map` as mutable because it is also borrowed as immutable",
             "Cache::get_or_insert", "src/cache.rs"),
            ("error: future cannot be sent between threads safely", "handle", "src/server.rs"),
        ],
    },
    "java": {
        "ext": "java",
        "test": "JUnit 5",
        "snippets": [
            '''public List<{Entity}> findActive(List<{Entity}> all) {
    List<{Entity}> out = new ArrayList<>();
    for ({Entity} x : all) {
        if (x.getStatus().equals("ACTIVE")) out.add(x);
    }
    return out;
}''',
            '''public synchronized void transfer(Account from, Account to, long cents) {
    if (from.getBalance() < cents) throw new InsufficientFundsException();
    from.withdraw(cents);
    to.deposit(cents);
}''',
            '''for (String id : ids) {
    if (id.isBlank()) ids.remove(id);
}''',
        ],
        "errors": [
            ("java.lang.NullPointerException: Cannot invoke \"String.equals(Object)\" because the return value "
             "of \"{Entity}.getStatus()\" is null", "findActive", "{Entity}Service.java"),
            ("java.util.ConcurrentModificationException", "cleanIds", "IdCleaner.java"),
            ("org.springframework.dao.DataIntegrityViolationException: could not execute statement",
             "save", "{Entity}Repository.java"),
        ],
    },
}

SQL_SCHEMAS = [
    '''CREATE TABLE orders (
  id BIGSERIAL PRIMARY KEY,
  customer_id BIGINT NOT NULL REFERENCES customers(id),
  status TEXT NOT NULL,
  total_cents BIGINT NOT NULL,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE TABLE customers (
  id BIGSERIAL PRIMARY KEY,
  email TEXT UNIQUE NOT NULL,
  country TEXT,
  created_at TIMESTAMPTZ NOT NULL DEFAULT now()
);''',
    '''CREATE TABLE events (
  id BIGINT PRIMARY KEY,
  device_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  payload JSONB,
  ts TIMESTAMP NOT NULL
);
CREATE INDEX events_ts ON events (ts);''',
    '''CREATE TABLE tickets (
  id INTEGER PRIMARY KEY,
  assignee_id INTEGER REFERENCES users(id),
  priority INTEGER NOT NULL CHECK (priority BETWEEN 1 AND 4),
  opened_at DATETIME NOT NULL,
  closed_at DATETIME
);
CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT NOT NULL, team TEXT NOT NULL);''',
]
SQL_ASKS = [
    "Write a query that returns, for each country, the number of customers who placed at least {k} orders "
    "in the last {n} days and their median order total.",
    "This query takes {n} seconds on {k}0M rows:\n\n```sql\nSELECT device_id, count(*) FROM events\n"
    "WHERE date(ts) = current_date - 1 AND kind = 'error'\nGROUP BY device_id ORDER BY 2 DESC LIMIT {n};\n```\n\n"
    "Explain why and rewrite it (and suggest an index if needed).",
    "For each team, compute the mean and p90 time-to-close of priority {k} tickets per week over the last {n} weeks, including weeks "
    "with no tickets as zero rows.",
    "I need a migration that splits `status` into a proper enum without locking the table for long on Postgres 15.",
    "Find customers whose first order was refunded and who never ordered again. Use window functions.",
    "Deduplicate `events` keeping the latest row per (device_id, kind, ts truncated to the minute).",
]
CI_LOGS = [
    '''Run pytest -q --maxfail=1
........................F
=================================== FAILURES ===================================
___________________________ test_{entity}_roundtrip ___________________________
    def test_{entity}_roundtrip(tmp_path):
        obj = make_{entity}()
        path = tmp_path / "{entity}.json"
        save(obj, path)
>       assert load(path) == obj
E       AssertionError: assert {Entity}(id=1, created_at=datetime(2024, 3, 1, 12, 0, tzinfo=UTC)) == {Entity}(id=1, created_at=datetime(2024, 3, 1, 12, 0))
tests/test_{entity}.py:18: AssertionError
1 failed, 24 passed in 3.12s
Error: Process completed with exit code 1.''',
    '''#12 [build 6/9] RUN npm ci
#12 12.43 npm ERR! code ERESOLVE
#12 12.43 npm ERR! ERESOLVE unable to resolve dependency tree
#12 12.43 npm ERR! Found: react@18.3.1
#12 12.43 npm ERR! Could not resolve dependency:
#12 12.43 npm ERR! peer react@"^17.0.0" from @acme/{entity}-widgets@2.4.0
#12 ERROR: process "/bin/sh -c npm ci" did not complete successfully: exit code: 1''',
    '''--- FAIL: Test{Entity}Cache (0.02s)
    --- FAIL: Test{Entity}Cache/concurrent (0.01s)
        cache_test.go:57: got 99 entries, want 100
WARNING: DATA RACE
Write at 0x00c0000b4060 by goroutine 9:
  {project}/cache.(*Cache).Put()
      /src/cache/cache.go:41 +0x84
Previous read at 0x00c0000b4060 by goroutine 8:
  {project}/cache.(*Cache).Get()
      /src/cache/cache.go:29 +0x5c
FAIL	{project}/cache	0.412s''',
    '''error[E0432]: unresolved import `tokio::sync::OnceCell`
 --> src/{entity}.rs:3:5
  |
3 | use tokio::sync::OnceCell;
  |     ^^^^^^^^^^^^^^^^^^^^^ no `OnceCell` in `sync`
  |
  = note: enabled features: "rt", "macros"
error: could not compile `{project}` (lib) due to 1 previous error''',
    '''mypy src/
src/{project_mod}/{entity}.py:42: error: Item "None" of "Optional[{Entity}]" has no attribute "id"  [union-attr]
src/{project_mod}/api.py:118: error: Argument 1 to "schedule" has incompatible type "str"; expected "datetime"  [arg-type]
Found 2 errors in 2 files (checked 57 source files)''',
]
REVIEW_DIFFS = [
    '''--- a/{project_mod}/{entity}_service.py
+++ b/{project_mod}/{entity}_service.py
@@ -31,9 +31,14 @@ class {Entity}Service:
     def cancel(self, {entity}_id: int, user: User) -> None:
-        {entity} = self.repo.get({entity}_id)
-        {entity}.status = "cancelled"
-        self.repo.save({entity})
+        {entity} = self.repo.get({entity}_id)
+        if {entity}.owner_id != user.id and not user.is_admin:
+            raise PermissionDenied()
+        {entity}.status = "cancelled"
+        self.repo.save({entity})
+        for hook in self.hooks:
+            hook({entity})
+        self.cache.delete(f"{entity}:{{{entity}_id}}")''',
    '''--- a/src/retry.ts
+++ b/src/retry.ts
@@ -1,12 +1,20 @@
-export async function retry<T>(fn: () => Promise<T>, attempts = 3): Promise<T> {
-  try {
-    return await fn();
-  } catch (e) {
-    if (attempts <= 1) throw e;
-    return retry(fn, attempts - 1);
-  }
+export async function retry<T>(fn: () => Promise<T>, attempts = 3, baseMs = 100): Promise<T> {
+  for (let i = 0; ; i++) {
+    try {
+      return await fn();
+    } catch (e) {
+      if (i >= attempts) throw e;
+      await new Promise((r) => setTimeout(r, baseMs * 2 ** i));
+    }
+  }
 }''',
    '''--- a/internal/pool/pool.go
+++ b/internal/pool/pool.go
@@ -18,6 +18,12 @@ func (p *Pool) Submit(j Job) {
-	p.jobs <- j
+	select {
+	case p.jobs <- j:
+	default:
+		go func() { p.jobs <- j }()
+	}
 }''',
]
FEATURES = [
    "add cursor-based pagination to the `GET /{entity}s` endpoint (keep offset pagination working for old clients)",
    "add an `--dry-run` flag to the `{project}` CLI that prints what would change without writing anything",
    "export Prometheus metrics for request latency and error counts per route",
    "support soft deletes for {entity}s, including a background job that purges them after 30 days",
    "make the {entity} import idempotent so re-running it after a crash does not create duplicates",
    "add structured JSON logging with a request id that follows the request across services",
    "add a feature flag so the new {entity} pricing rules can be rolled out to 5% of accounts",
    "rate-limit the public API per API key using a token bucket stored in Redis",
]
REFACTOR_ASKS = [
    "Refactor this to be easier to test: separate the I/O from the logic.",
    "This works but is hard to read. Refactor it without changing behaviour and explain each change.",
    "Make this thread-safe and explain what race you are fixing.",
    "Rewrite this in idiomatic {lang} and keep the public signature.",
    "Remove the duplication between these call sites and add type annotations.",
    "Convert this to async without blocking the event loop.",
]
EXPLAIN_ASKS = [
    "What does this code do, and what happens at the edge cases (empty input, very large input)?",
    "Why does this sometimes return stale data?",
    "Is there an off-by-one error here? Walk me through it with an example.",
    "What is the time and space complexity, and can it be improved?",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the repository root and return stdout, stderr and exit code.",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command line to run."},
                    "timeout_s": {"type": "integer", "description": "Seconds before the command is killed."},
                },
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file from the repository.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "start_line": {"type": "integer"},
                    "end_line": {"type": "integer"},
                },
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Replace the whole content of a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_code",
            "description": "Search the repository with a regular expression; returns matching lines with paths.",
            "parameters": {
                "type": "object",
                "properties": {"pattern": {"type": "string"}, "glob": {"type": "string"}},
                "required": ["pattern"],
            },
        },
    },
]

# ------------------------------------------------------------------ helpers


class Ctx:
    """One row's random choices, so templates can be filled consistently."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lang = rng.choice(list(LANGS))
        self.project = rng.choice(PROJECTS)
        self.entity = rng.choice(ENTITIES)

    def fill(self, text: str) -> str:
        return (
            text.replace("{Entity}", self.entity.capitalize())
            .replace("{entity}", self.entity)
            .replace("{project_mod}", self.project.replace("-", "_"))
            .replace("{project}", self.project)
            .replace("{lang}", self.lang)
        )

    def snippet(self) -> str:
        return self.fill(self.rng.choice(LANGS[self.lang]["snippets"]))

    def fence(self, code: str, lang: str | None = None) -> str:
        return f"```{lang or self.lang}\n{code}\n```"


def _trace(ctx: Ctx) -> str:
    rng = ctx.rng
    err, func, file = LANGS[ctx.lang]["errors"][rng.randrange(len(LANGS[ctx.lang]["errors"]))]
    err, func, file = ctx.fill(err), ctx.fill(func), ctx.fill(file)
    depth = rng.randint(2, 9)
    if ctx.lang == "python":
        frames = [f'  File "/srv/{ctx.project}/{ctx.fill("{project_mod}")}/{rng.choice(["api", "jobs", "core", "db"])}'
                  f'/{rng.choice(["views", "tasks", "service", "utils"])}.py", line {rng.randint(10, 400)}, in '
                  f'{rng.choice(["dispatch", "run", "wrapper", "__call__", "handle"])}\n    '
                  f'{rng.choice(["return fn(*args, **kwargs)", "result = self.process(item)", "await handler(req)"])}'
                  for _ in range(depth)]
        frames.append(f'  File "/srv/{ctx.project}/{file}", line {rng.randint(10, 200)}, in {func}')
        return "Traceback (most recent call last):\n" + "\n".join(frames) + f"\n{err}"
    if ctx.lang == "typescript":
        frames = [f"    at {rng.choice(['processTicksAndRejections', 'renderWithHooks', 'Object.handler', 'next'])} "
                  f"(node:internal/process/task_queues:{rng.randint(50, 120)}:{rng.randint(1, 30)})"
                  for _ in range(depth)]
        return f"{err}\n    at {func} ({file}:{rng.randint(5, 90)}:{rng.randint(3, 40)})\n" + "\n".join(frames)
    if ctx.lang == "go":
        frames = [f"{ctx.project}/internal/{rng.choice(['http', 'store', 'pool', 'rpc'])}."
                  f"{rng.choice(['serve', 'dispatch', 'run', 'Handle'])}(...)\n\t/src/internal/x.go:{rng.randint(10, 300)}"
                  f" +0x{rng.randint(16, 4095):x}" for _ in range(depth)]
        return f"{err}\n\ngoroutine {rng.randint(1, 900)} [running]:\n{ctx.project}/{func}(...)\n\t/src/{file}:" \
               f"{rng.randint(10, 200)}\n" + "\n".join(frames) + "\nexit status 2"
    if ctx.lang == "rust":
        return f"{err}, {file}:{rng.randint(5, 120)}:{rng.randint(5, 40)}\nnote: run with `RUST_BACKTRACE=1` " \
               f"environment variable to display a backtrace\n" + "\n".join(
                   f"  {i}: {rng.choice(['core::panicking::panic', 'std::rt::lang_start', func, 'tokio::runtime::task'])}"
                   for i in range(depth))
    frames = [f"\tat com.acme.{ctx.project.replace('-', '')}.{rng.choice(['web', 'service', 'repo'])}."
              f"{rng.choice(['Dispatcher', 'Controller', 'Job'])}.{rng.choice(['run', 'handle', 'invoke'])}"
              f"({rng.choice(['Dispatcher', 'Controller', 'Job'])}.java:{rng.randint(10, 300)})" for _ in range(depth)]
    return f"Exception in thread \"main\" {err}\n\tat com.acme.{func}({file}:{rng.randint(10, 200)})\n" + "\n".join(frames)


def _maybe_system(ctx: Ctx, msgs: list[dict[str, Any]], p: float = 0.6) -> list[dict[str, Any]]:
    if ctx.rng.random() < p:
        return [{"role": "system", "content": ctx.rng.choice(SYSTEM_PROMPTS)}, *msgs]
    return msgs


def _context_blurb(ctx: Ctx) -> str:
    rng = ctx.rng
    bits = [
        f"We're on {rng.choice(['Python 3.11', 'Python 3.12', 'Node 20', 'Go 1.22', 'Rust 1.79', 'Java 21'])}.",
        f"This is in `{ctx.project}`, which handles {ctx.entity}s for about {rng.choice(['2k', '40k', '1.2M'])} "
        "customers.",
        "It started after the last deploy.",
        "It only happens under load, never locally.",
        "I already tried restarting the service; it comes back within an hour.",
        "Please keep the change small, this goes out in a hotfix.",
        "We can't upgrade dependencies this sprint.",
        "The team prefers explicit code over clever one-liners.",
    ]
    return " ".join(rng.sample(bits, rng.randint(0, 4)))


# ------------------------------------------------------------------ categories


def bug_report(ctx: Ctx) -> dict[str, Any]:
    trace = _trace(ctx)
    # Show the code the trace points at when we have it, so the report reads as one story.
    func = trace.split(" in ")[-1].split("\n")[0] if ctx.lang == "python" else ""
    matching = [s for s in LANGS[ctx.lang]["snippets"] if func and f"def {func}" in s]
    code = ctx.fill(ctx.rng.choice(matching)) if matching else ctx.snippet()
    if ctx.rng.random() < 0.25:  # a longer report: the caller and a config file too
        code += "\n\n" + ctx.snippet()
    opener = ctx.rng.choice([
        "I'm getting this error and can't figure out why:",
        "Production is throwing this since this morning:",
        "Can you help me fix this crash?",
        "Our on-call got paged for this:",
    ])
    text = f"{opener}\n\n```\n{trace}\n```\n\nHere's the relevant code:\n\n{ctx.fence(code)}\n\n{_context_blurb(ctx)}"
    if ctx.rng.random() < 0.3:
        text += "\n\nAlso, how do I make sure this doesn't regress? A test would be great."
    return {"messages": _maybe_system(ctx, [{"role": "user", "content": text.strip()}])}


def refactor(ctx: Ctx) -> dict[str, Any]:
    code = "\n\n".join(ctx.snippet() for _ in range(ctx.rng.randint(1, 3)))
    ask = ctx.fill(ctx.rng.choice(REFACTOR_ASKS))
    text = f"{ask}\n\n{ctx.fence(code)}\n\n{_context_blurb(ctx)}"
    return {"messages": _maybe_system(ctx, [{"role": "user", "content": text.strip()}])}


def test_writing(ctx: Ctx) -> dict[str, Any]:
    code = ctx.snippet()
    tool = LANGS[ctx.lang]["test"]
    ask = ctx.rng.choice([
        f"Write {tool} tests for this. Cover the edge cases, not just the happy path.",
        f"Our coverage on this file is 12%. Add {tool} tests; use table-driven/parametrized tests where it helps.",
        f"Write a property-based test for this (use whatever is idiomatic with {tool}).",
        f"I think this has a bug. Write a failing {tool} test that demonstrates it, then fix it.",
    ])
    return {"messages": _maybe_system(ctx, [{"role": "user", "content": f"{ask}\n\n{ctx.fence(code)}"}])}


def code_review(ctx: Ctx) -> dict[str, Any]:
    diff = ctx.fill(ctx.rng.choice(REVIEW_DIFFS))
    ask = ctx.rng.choice([
        "Please review this PR. Be blunt about anything that could break in production.",
        "Review this diff. Is it safe to merge? What tests are missing?",
        "A junior engineer sent this. Give review comments I can paste, with line references.",
    ])
    text = f"{ask}\n\n```diff\n{diff}\n```"
    if ctx.rng.random() < 0.4:
        text += "\n\nPR description: " + ctx.rng.choice([
            "Fixes the flaky behaviour reported in #" + str(ctx.rng.randint(100, 9999)) + ".",
            "Small cleanup, no behaviour change.",
            "Adds authorization and cache invalidation to cancellation.",
        ])
    return {"messages": _maybe_system(ctx, [{"role": "user", "content": text}], p=0.8)}


def sql(ctx: Ctx) -> dict[str, Any]:
    schema = ctx.rng.choice(SQL_SCHEMAS)
    ask = ctx.rng.choice(SQL_ASKS).replace("{n}", str(ctx.rng.randint(7, 90))).replace("{k}", str(ctx.rng.randint(2, 4)))
    engine = ctx.rng.choice(["PostgreSQL 15", "PostgreSQL 16", "SQLite", "MySQL 8", "BigQuery"])
    text = f"Database: {engine}.\n\n```sql\n{schema}\n```\n\n{ask}"
    return {"messages": _maybe_system(ctx, [{"role": "user", "content": text}], p=0.3)}


def ci_failure(ctx: Ctx) -> dict[str, Any]:
    log = ctx.fill(ctx.rng.choice(CI_LOGS))
    ask = ctx.rng.choice([
        "CI is red on main and I don't see why. Here's the log:",
        "This passes locally but fails in GitHub Actions:",
        "Our nightly build broke. What's the fix?",
    ])
    text = f"{ask}\n\n```\n{log}\n```\n\n{_context_blurb(ctx)}"
    return {"messages": _maybe_system(ctx, [{"role": "user", "content": text.strip()}])}


def feature(ctx: Ctx) -> dict[str, Any]:
    want = ctx.fill(ctx.rng.choice(FEATURES))
    code = ctx.snippet()
    text = (f"In `{ctx.project}` ({ctx.lang}), I need to {want}. Here is roughly how the code looks today:\n\n"
            f"{ctx.fence(code)}\n\nPropose the design first, then the implementation. {_context_blurb(ctx)}")
    return {"messages": _maybe_system(ctx, [{"role": "user", "content": text.strip()}])}


def explain(ctx: Ctx) -> dict[str, Any]:
    path = f"{ctx.project}/src/{ctx.entity}/{ctx.rng.choice(['core', 'util', 'store', 'sync'])}.{LANGS[ctx.lang]['ext']}"
    text = f"From `{path}`. {ctx.rng.choice(EXPLAIN_ASKS)}\n\n{ctx.fence(ctx.snippet())}"
    return {"messages": [{"role": "user", "content": text}]}


def _call(ctx: Ctx, n: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"id": f"call_{n:02d}{ctx.rng.randrange(16**6):06x}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def tool_use(ctx: Ctx) -> dict[str, Any]:
    """A multi-turn agent transcript that stops after a tool result: the model's next step is the completion."""
    rng = ctx.rng
    ext = LANGS[ctx.lang]["ext"]
    task = rng.choice([
        f"The {LANGS[ctx.lang]['test']} suite is failing on `{ctx.entity}` tests. Find out why and fix it.",
        ctx.fill(f"Implement this: {rng.choice(FEATURES)}."),
        f"Find every place we build {ctx.entity} URLs by string concatenation and switch them to the helper.",
        "Upgrade the logging setup so every module uses the shared logger, then run the tests.",
        f"Why is `{ctx.project}` using 3 GB of memory at startup? Investigate and propose a fix.",
    ])
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPTS[4] + f" Repository: {ctx.project}."},
        {"role": "user", "content": task},
    ]
    path = f"src/{ctx.entity}/{rng.choice(['service', 'handler', 'model', 'client'])}.{ext}"
    steps = rng.choice([1, 1, 2, 2, 3, 3, 4, 5, 6, 8])
    for n in range(steps):
        kind = rng.choice(["shell", "read", "search", "shell"])
        thought = rng.choice([
            "Let me look at the repository layout first.",
            "I'll reproduce the failure before changing anything.",
            f"The error points at `{path}`; reading it.",
            "Searching for other call sites.",
            "",
        ])
        if kind == "shell":
            cmd = rng.choice([
                f"{'pytest -x -q' if ctx.lang == 'python' else LANGS[ctx.lang]['test']} 2>&1 | tail -40",
                "git log --oneline -8", "ls -la src", f"grep -rn '{ctx.entity}_url' src | head",
                "git diff --stat HEAD~1",
            ])
            call = _call(ctx, n, "run_shell", {"command": cmd})
            result = json.dumps({"exit_code": rng.choice([0, 0, 1]), "stdout": ctx.fill(rng.choice([
                "a1f3c9e fix: {entity} totals rounding\n77be021 feat: bulk {entity} import\n3c0d4aa chore: bump deps",
                _trace(ctx), "src/{entity}/service.py:41:    url = base + '/{entity}s/' + str(id)",
                "total 24\ndrwxr-xr-x 5 dev dev 4096 api\ndrwxr-xr-x 3 dev dev 4096 {entity}\n-rw-r--r-- 1 dev dev 812 main",
            ])), "stderr": ""})
        elif kind == "read":
            call = _call(ctx, n, "read_file", {"path": path})
            result = "\n".join(f"{i + 1:4d}  {line}" for i, line in enumerate(ctx.snippet().splitlines()))
        else:
            call = _call(ctx, n, "search_code", {"pattern": f"{ctx.entity}_(url|id)", "glob": f"*.{ext}"})
            result = "\n".join(f"src/{ctx.entity}/{m}.{ext}:{rng.randint(3, 300)}: ... {ctx.entity}_id ..."
                               for m in rng.sample(["api", "jobs", "model", "views", "client", "util"], rng.randint(1, 5)))
        msgs.append({"role": "assistant", "content": thought or None, "tool_calls": [call]})
        msgs.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"], "content": result})
    tools = rng.sample(TOOLS, rng.randint(2, 4))
    names = {t["function"]["name"] for t in tools}
    # Every tool used in the transcript must be declared.
    for m in msgs:
        for c in m.get("tool_calls") or []:
            if c["function"]["name"] not in names:
                tools.append(next(t for t in TOOLS if t["function"]["name"] == c["function"]["name"]))
                names.add(c["function"]["name"])
    return {"messages": msgs, "tools": tools}


def followup(ctx: Ctx) -> dict[str, Any]:
    """Two user turns with an earlier assistant answer: the completion is the second answer."""
    first = bug_report(ctx)["messages"]
    answer = ctx.fill(ctx.rng.choice([
        "The crash comes from assuming the lookup always succeeds. Guard the missing case and return early:\n\n"
        "```\nif {entity} is None:\n    raise NotFound(\"{entity} not found\")\n```",
        "This is a race: two workers read the same state before either writes. Take the lock around the whole "
        "read-modify-write, or use an atomic upsert.",
        "The list is mutated while iterating. Build a new list instead of removing in place.",
    ]))
    follow = ctx.rng.choice([
        "That fixed it, thanks. Now the same test fails with a timeout on CI only. Ideas?",
        "Can you also add a regression test for it?",
        "Your fix works but it's slower. Can we avoid the lock?",
        "Can you explain why it only happened under load?",
    ])
    return {"messages": [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": follow}]}


CATEGORIES: list[tuple[str, float, Callable[[Ctx], dict[str, Any]]]] = [
    ("bug_report", 0.20, bug_report),
    ("tool_use", 0.20, tool_use),
    ("refactor", 0.10, refactor),
    ("test_writing", 0.10, test_writing),
    ("code_review", 0.09, code_review),
    ("sql", 0.08, sql),
    ("ci_failure", 0.08, ci_failure),
    ("feature", 0.07, feature),
    ("explain", 0.04, explain),
    ("followup", 0.04, followup),
]


def generate(rows: int = SAMPLE_ROWS, seed: int = SEED) -> Iterator[dict[str, Any]]:
    """The sample rows, in order: same rows and seed → same output."""
    rng = random.Random(seed)
    names = [c[0] for c in CATEGORIES]
    weights = [c[1] for c in CATEGORIES]
    makers = {c[0]: c[2] for c in CATEGORIES}
    seen: set[int] = set()
    for i in range(rows):
        # Redraw the rare exact duplicate: the same prompt twice would just cost GPU time twice.
        while True:
            category = rng.choices(names, weights)[0]
            row = makers[category](Ctx(rng))
            key = hash(json.dumps(row, sort_keys=True))
            if key not in seen:
                seen.add(key)
                break
        yield {"id": f"tg-sample-{i:05d}", "category": category, **row}


def write(path: Path, rows: int = SAMPLE_ROWS, seed: int = SEED) -> None:
    lines = (json.dumps(r, ensure_ascii=False, separators=(",", ":")).encode() for r in generate(rows, seed))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as out:
        write_multimember_gzip(lines, out, ROWS_PER_MEMBER)
    tmp.replace(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=SAMPLE_ROWS)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--out", type=Path, default=SAMPLE_DATASET)
    args = ap.parse_args(argv)
    write(args.out, args.rows, args.seed)
    print(f"wrote {args.rows} rows to {args.out} ({args.out.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main()
