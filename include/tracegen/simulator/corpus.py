"""The stand-in's text: deterministic agentic-coding prose and code, in two registers.

A model answers in the language it is asked in, and agentic coding text is not ASCII: arrows and dashes in
prose, unicode in string literals and comments, emoji in status lines, a Chinese or Japanese comment here
and there. The stand-in's completions are windows of two long token streams (`tokens.Stream`), the
tokenization of the text generated here:

- `en`: English reasoning, code blocks, shell output and lists, with non-ASCII characters at the rate an
  agentic coding transcript has them (about 1-2% of characters: `→ — … “ ” ✓ ✅ ❌ 🚀 é ü ├──`, a CJK comment
  now and then);
- `intl`: the same kinds of text written for a user who asked in Chinese or Japanese: CJK prose (common
  characters and a long tail of rare ones, as real CJK text has), code with CJK comments and strings, emoji.

Everything is drawn from `random.Random` with fixed seeds: the text, and so the streams, are the same on
every server of a fleet and across releases of the stand-in unless this module changes (then the shipped
streams are tokenized again: `python -m tracegen.simulator.make_tokenizer`).
"""

from __future__ import annotations

import random

EN_WORDS = (
    "the test fails because the fixture returns a stale value when cache is empty so we need to check "
    "how config loader handles missing keys and then update parser before running suite again this "
    "function should return none instead of raising error path may not exist yet which means write file "
    "first look at traceback line number points into helper module where list gets mutated while iterating "
    "over it fix is copy before loop also add regression case that covers duplicate entries order matters "
    "here since callers rely on stable sorting by timestamp then name let me verify assumption with small "
    "example input output expected actual mismatch happens only on windows because separator differs "
    "probably easiest approach normalise paths early keep rest unchanged another option would be wrap call "
    "retry logic but that hides real problem instead I will read source more carefully constructor sets "
    "attribute lazily property computes on first access thread safety concern two workers race same "
    "lock missing around update counter increments twice sometimes flaky failure explains intermittent "
    "timeout seen in logs yesterday schema migration adds column default null older rows break query "
    "filter compares strings numbers mixed type coercion silently wrong result should validate input "
    "raise clear message caller can handle gracefully documentation mentions behaviour but code does "
    "opposite decide which one is right ask user or follow tests they encode intent better than comments"
).split()
IDENT_PARTS = (
    "parse load save read write get set update build make check validate normalize resolve fetch merge "
    "split join render format apply reset flush close open init run start stop handle process compute "
    "config path file user data item entry node tree cache index token request response client server "
    "session state result value key name list map queue batch chunk row record ledger part report table"
).split()
EXTS = ("py", "ts", "rs", "go", "md", "json", "yaml", "toml", "sh", "sql")
DIRS = ("src", "lib", "tests", "app", "core", "utils", "api", "cli", "docs", "scripts")
LATIN = ("café", "naïve", "résumé", "Zoë", "Müller", "São Paulo", "Ångström", "façade", "jalapeño",
         "Gödel", "Łódź", "Dvořák", "coöperate", "Ærø", "Straße", "déjà vu", "Привет", "мир", "Ελλάδα")
SYMBOLS = ("→", "—", "…", "≈", "≤", "≥", "×", "±", "°", "µs", "✓", "✗", "⇒", "←", "↔", "•", "∑", "∞", "≠", "√")
EMOJI = ("✅", "❌", "⚠️", "🚀", "🐛", "📦", "🔧", "💡", "🎉", "🔍", "📝", "🔥", "✨", "👍", "🙂", "🤔",
         "⏱️", "🧪", "📌", "🛠️", "💥", "🟢", "🔴", "🧹", "📈", "🗂️", "🧵", "🦀", "🐍", "☕")
TREE = ("├── ", "└── ", "│   ", "    ")
# The most common Chinese characters (the head of the distribution, each a single token after training),
# then a long tail drawn from the CJK block, most of which stay two or three tokens a character.
ZH_COMMON = (
    "的一是不了在人有我他这个们中来上大为和国地到以说时要就出会可也你对生能而子那得于着下自之年过发后作里用"
    "道行所然家种事成方多经么去法学如都同现当没动面起看定天分还进好小部其些主样理心她本前开但因只从想实日者"
    "意无力它与长把机十民第公此已工使情明性知全三又关点正业外将两高间由问很最重并物手应向头文体政美相见被利"
    "什二等产或新己制身果加西斯月话合回特代内信表化老给世位次度门任常先海通教儿原东声提立及比员解水名真论处"
    "走义各入几口认条平系气题活尔更别打女变四神总何电数安少报才结反受目太量再感建务做接必场件计管期市直德资"
    "命山金指克许统区保至队形社便空决治展马科司五基眼书非则听白却界达光放强即像难且权思王象完设式色路记南品"
    "住告类求据程北边死张该交规万取拉格望觉术领共确传师观清今切院让识候带导争运笑飞风步改收根干造言联持组每"
    "函数测试代码文件路径配置参数返回错误异常修复问题运行检查逻辑变量类型列表字典缓存日志模块接口调用输入输出"
)
ZH_PUNCT = ("，", "。", "：", "、", "（", "）", "“", "”", "；", "！", "？")
JA = ("この関数は", "テストが失敗します", "ファイルを読み込む", "設定を確認してください", "エラーが発生した場合",
      "キャッシュをクリアする", "修正しました", "次に", "ですが", "と思います", "データベース", "ログを見ると")
KO = ("함수를 확인합니다", "테스트가 실패했습니다", "파일 경로", "수정 완료", "설정 파일")


def _ident(rng: random.Random) -> str:
    n = rng.choice((1, 2, 2, 3))
    return "_".join(rng.choice(IDENT_PARTS) for _ in range(n))


def _path(rng: random.Random) -> str:
    return f"{rng.choice(DIRS)}/{_ident(rng)}.{rng.choice(EXTS)}"


def _rare_cjk(rng: random.Random) -> str:
    # The tail: characters of the main CJK block, ranked log-uniformly (a few hundred recur, thousands appear
    # once or twice) and scattered over the block by a prime stride.
    return chr(0x4E00 + (int(20_000 ** rng.random()) * 7919) % 20_900)


def _emoji(rng: random.Random) -> str:
    """A common emoji, or one from the long tail of the pictograph blocks (as many as people use)."""
    if rng.random() < 0.5:
        return rng.choice(EMOJI)
    return chr(rng.choice((0x1F300, 0x1F680, 0x1F900)) + rng.randrange(0, 0x80 if rng.random() < 0.7 else 0x100))


def _symbol(rng: random.Random) -> str:
    """A common symbol, or one from the arrows, math operators and misc technical blocks."""
    if rng.random() < 0.7:
        return rng.choice(SYMBOLS)
    return chr(rng.choice((0x2190, 0x2200, 0x2300, 0x25A0)) + rng.randrange(0, 0x60))


def _zh_char(rng: random.Random, rare: float) -> str:
    if rng.random() < rare:
        return _rare_cjk(rng)
    # Zipf-like over the common set: low indices much more often.
    return ZH_COMMON[int(len(ZH_COMMON) ** rng.random()) - 1]


class _Writer:
    """One register's text generator."""

    def __init__(self, seed: int, register: str) -> None:
        self.rng = random.Random(seed)
        self.register = register

    # -- English pieces ------------------------------------------------------------------------------
    def words(self, lo: int, hi: int) -> str:
        r = self.rng
        out = []
        for _ in range(r.randint(lo, hi)):
            x = r.random()
            if x < 0.05:
                out.append(f"`{_ident(r)}`")
            elif x < 0.07:
                out.append(str(r.choice((r.randint(0, 99), r.randint(100, 99_999), round(r.random() * 10, 2)))))
            elif x < 0.075:
                out.append(r.choice(LATIN))
            elif x < 0.085 and self.register == "en":
                out.append(_symbol(r))
            else:
                out.append(r.choice(EN_WORDS))
        return " ".join(out)

    def sentence(self) -> str:
        r = self.rng
        s = self.words(4, 16)
        s = s[0].upper() + s[1:]
        kind = r.random()
        if kind < 0.08:
            s += f" {r.choice(('→', '—', '⇒', '...'))} {self.words(2, 8)}"
        elif kind < 0.12:
            s += f", “{self.words(1, 4)}”"
        elif kind < 0.15:
            s += f" in `{_path(r)}`"
        elif kind < 0.17:
            s += f" {_emoji(r)}"
        return s + r.choice((".", ".", ".", ":", "?", "!", "…"))

    def code(self) -> str:
        r = self.rng
        lang = r.choice(("python", "python", "typescript", "rust", "bash"))
        lines = []
        for _ in range(r.randint(3, 14)):
            ind = "    " * r.randint(0, 2)
            x = r.random()
            name = _ident(r)
            if x < 0.2:
                comment = self.comment()
                lines.append(f"{ind}{'//' if lang in ('typescript', 'rust') else '#'} {comment}")
            elif x < 0.35:
                lines.append(f"{ind}def {name}({_ident(r)}, {_ident(r)}=None):" if lang == "python"
                             else f"{ind}fn {name}({_ident(r)}: &str) -> Result<(), Error> {{")
            elif x < 0.5:
                lines.append(f'{ind}{name} = "{self.literal()}"')
            elif x < 0.65:
                lines.append(f"{ind}if {name} is None or len({_ident(r)}) > {r.randint(0, 512)}:")
            elif x < 0.8:
                lines.append(f"{ind}return {name}({_ident(r)}[{r.randint(0, 9)}], {r.random():.3f})")
            else:
                lines.append(f"{ind}{name}.{_ident(r)}({_ident(r)}, key=lambda x: x.{_ident(r)})")
        return f"```{lang}\n" + "\n".join(lines) + "\n```"

    def comment(self) -> str:
        r = self.rng
        if self.register == "intl" and r.random() < 0.6:
            return self.zh(4, 14) if r.random() < 0.8 else r.choice(JA)
        if r.random() < 0.06:
            return self.zh(3, 8)  # an English project with a CJK-speaking contributor
        return self.words(3, 9) + (f" {_symbol(r)}" if r.random() < 0.2 else "")

    def literal(self) -> str:
        r = self.rng
        x = r.random()
        if x < 0.15:
            return f"{_emoji(r)} {self.words(1, 3)}"
        if x < 0.25:
            return r.choice(LATIN)
        if x < 0.32 or (self.register == "intl" and x < 0.6):
            return self.zh(2, 8)
        if x < 0.4:
            return f"{self.words(1, 2)} {_symbol(r)} {self.words(1, 2)}"
        return self.words(1, 4)

    def shell(self) -> str:
        r = self.rng
        lines = [f"$ {r.choice(('pytest -q', 'cargo test', 'npm test', 'make lint', 'git diff --stat'))} "
                 f"{_path(r)}"]
        for _ in range(r.randint(1, 5)):
            x = r.random()
            if x < 0.3:
                lines.append(f"{r.choice(('✅', '❌', '⚠️', 'PASSED', 'FAILED'))} {_path(r)}::{_ident(r)}")
            elif x < 0.55:
                lines.append(f"{r.randint(1, 300)} passed, {r.randint(0, 9)} failed in {r.random() * 30:.2f}s")
            elif x < 0.75:
                lines.append(f"{r.choice(TREE)}{r.choice(TREE) if r.random() < 0.5 else ''}{_path(r)}")
            else:
                lines.append(f"E   AssertionError: {self.words(2, 7)}")
        return "```\n" + "\n".join(lines) + "\n```"

    def bullets(self) -> str:
        r = self.rng
        mark = r.choice(("-", "*", "•", "1.", "→"))
        items = []
        for i in range(r.randint(2, 6)):
            m = f"{i + 1}." if mark == "1." else mark
            items.append(f"{m} {self.sentence() if self.register == 'en' or r.random() < 0.3 else self.zh_sentence()}")
        return "\n".join(items)

    # -- CJK pieces ----------------------------------------------------------------------------------
    def zh(self, lo: int, hi: int) -> str:
        r = self.rng
        # Rare characters are most of what a small vocabulary splits: a register written for a CJK reader
        # uses many (names, technical terms), a quoted comment in English text few.
        rare = 0.6 if self.register == "intl" else 0.2
        return "".join(_zh_char(r, rare) for _ in range(r.randint(lo, hi)))

    def zh_sentence(self) -> str:
        r = self.rng
        parts = []
        for _ in range(r.randint(2, 5)):
            x = r.random()
            if x < 0.12:
                parts.append(f"`{_ident(r)}`")
            elif x < 0.18:
                parts.append(r.choice(JA))
            elif x < 0.2:
                parts.append(r.choice(KO))
            elif x < 0.25:
                parts.append(_path(r))
            else:
                parts.append(self.zh(3, 14))
            parts.append(r.choice(ZH_PUNCT[:3]) if r.random() < 0.5 else "")
        s = "".join(parts).rstrip("，、：")
        if r.random() < 0.12:
            s += _emoji(r)
        return s + r.choice(("。", "。", "！", "？", "：", "。"))

    # -- paragraphs ----------------------------------------------------------------------------------
    def paragraph(self) -> str:
        r = self.rng
        x = r.random()
        if x < (0.14 if self.register == "en" else 0.1):
            return self.code()
        if x < (0.2 if self.register == "en" else 0.13):
            return self.shell()
        if x < (0.28 if self.register == "en" else 0.2):
            return self.bullets()
        if self.register == "intl" and x < 0.92:
            return "".join(self.zh_sentence() for _ in range(r.randint(2, 6)))
        if self.register == "en" and x < 0.285:
            return self.zh_sentence()  # the user's own language quoted back
        return " ".join(self.sentence() for _ in range(r.randint(2, 6)))


def text(register: str, chars: int, seed: int = 0) -> str:
    """About `chars` characters of the register's text (whole paragraphs, joined by blank lines)."""
    if register not in REGISTERS:
        raise ValueError(f"unknown register {register!r}: one of {REGISTERS}")
    writer = _Writer(hash_seed(register, seed), register)
    out: list[str] = []
    n = 0
    while n < chars:
        p = writer.paragraph()
        out.append(p)
        n += len(p) + 2
    return "\n\n".join(out) + "\n\n"


def hash_seed(register: str, seed: int) -> int:
    return 20_240_607 + 7919 * seed + sum(ord(c) * 31**i for i, c in enumerate(register))


REGISTERS = ("en", "intl")
