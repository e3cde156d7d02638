// Markdown rendering for untrusted text (worker and conductor output).
//
// Pipeline: marked (GFM) turns markdown into HTML, highlight.js colours fenced code, KaTeX
// typesets $…$ / $$…$$, and DOMPurify reduces the result to a small allowlist before it
// reaches `{@html}`. KaTeX's markup needs inline styles, SVG and MathML, none of which worker
// HTML may carry, so math is typeset apart: the parser leaves a placeholder element carrying a
// per-call random nonce, the sanitizer keeps it, and only afterwards is it swapped for KaTeX's
// output (safe for untrusted input with `trust: false`: KaTeX escapes all text and rejects
// \href, \url, \includegraphics, \htmlStyle and friends).
//
// Streamed text goes through `StreamingMarkdown`, which renders each finished top-level block
// once and only the open tail again on each update, so a long answer costs the same per delta at
// its end as at its start.

import DOMPurify, { type Config } from "dompurify";
import hljs from "highlight.js/lib/core";
import bash from "highlight.js/lib/languages/bash";
import c from "highlight.js/lib/languages/c";
import cpp from "highlight.js/lib/languages/cpp";
import csharp from "highlight.js/lib/languages/csharp";
import css from "highlight.js/lib/languages/css";
import diff from "highlight.js/lib/languages/diff";
import go from "highlight.js/lib/languages/go";
import ini from "highlight.js/lib/languages/ini";
import java from "highlight.js/lib/languages/java";
import javascript from "highlight.js/lib/languages/javascript";
import json from "highlight.js/lib/languages/json";
import kotlin from "highlight.js/lib/languages/kotlin";
import markdown from "highlight.js/lib/languages/markdown";
import php from "highlight.js/lib/languages/php";
import plaintext from "highlight.js/lib/languages/plaintext";
import python from "highlight.js/lib/languages/python";
import ruby from "highlight.js/lib/languages/ruby";
import rust from "highlight.js/lib/languages/rust";
import shell from "highlight.js/lib/languages/shell";
import sql from "highlight.js/lib/languages/sql";
import swift from "highlight.js/lib/languages/swift";
import typescript from "highlight.js/lib/languages/typescript";
import xml from "highlight.js/lib/languages/xml";
import yaml from "highlight.js/lib/languages/yaml";
import katex, { type KatexOptions } from "katex";
import "katex/dist/katex.min.css";
import { Marked, type Token, type Tokens, type TokensList } from "marked";
import markedKatex from "marked-katex-extension";

// lib/core plus an explicit list keeps the bundle far smaller than highlight.js's ~190 languages.
// ini also covers TOML; xml covers HTML and SVG.
const LANGUAGES = {
  bash, c, cpp, csharp, css, diff, go, ini, java, javascript, json, kotlin, markdown, php,
  plaintext, python, ruby, rust, shell, sql, swift, typescript, xml, yaml,
};
for (const [name, language] of Object.entries(LANGUAGES)) hljs.registerLanguage(name, language);

const HTML_ESCAPES: Record<string, string> = {
  "&": "&amp;",
  "<": "&lt;",
  ">": "&gt;",
  '"': "&quot;",
  "'": "&#39;",
};

/** Escapes text for use in HTML content and in quoted attribute values. */
export function escapeHtml(text: string): string {
  return text.replace(/[&<>"']/g, (ch) => HTML_ESCAPES[ch]);
}

// --- Math -----------------------------------------------------------------------------------

const KATEX_OPTIONS: KatexOptions = {
  // Half-written or wrong TeX shows as a red error span instead of throwing mid-stream.
  throwOnError: false,
  trust: false,
  // Unicode in math mode and similar LaTeX incompatibilities are common in model output and
  // harmless; the default "warn" would flood the console on every streamed update.
  strict: "ignore",
  // Bounds \rule and friends so a worker cannot paint a huge box over the page.
  maxSize: 20,
  maxExpand: 1000,
};

type MathToken = Tokens.Generic & {
  type: "inlineKatex" | "blockKatex";
  text: string;
  displayMode: boolean;
  /** The placeholder this token renders as; set by `renderMarkdown` before parsing. */
  placeholder?: string;
};

function isMathToken(token: Tokens.Generic): token is MathToken {
  return token.type === "inlineKatex" || token.type === "blockKatex";
}

// A streamed answer's open tail is rendered again on every delta, so the same formulas come back
// again and again; typesetting is the expensive part. Cleared wholesale when full: simple and
// bounded.
const MATH_CACHE_LIMIT = 500;
const mathCache = new Map<string, string>();

function typeset(tex: string, displayMode: boolean): string {
  const key = (displayMode ? "D" : "I") + tex;
  let html = mathCache.get(key);
  if (html === undefined) {
    html = katex.renderToString(tex, { ...KATEX_OPTIONS, displayMode });
    if (mathCache.size >= MATH_CACHE_LIMIT) mathCache.clear();
    mathCache.set(key, html);
  }
  return html;
}

// --- Code -----------------------------------------------------------------------------------

// Whether a block without a language is highlighted by guessing one. Guessing runs every
// grammar over the code, far too slow to repeat on each delta of a block still being written,
// so the open tail of a stream shows such a block plain until it is finished. Set only around a
// synchronous parse (`renderTokens`).
let guessLanguages = true;

/** Highlighted HTML for a fenced block and the class list for its `<code>` element. */
function highlight(code: string, infoString: string): { html: string; className: string } {
  const lang = infoString.split(/\s/)[0];
  if (lang === "") {
    if (!guessLanguages) return { html: escapeHtml(code), className: "hljs" };
    const result = hljs.highlightAuto(code);
    return { html: result.value, className: languageClass(result.language) };
  }
  if (hljs.getLanguage(lang)) {
    const result = hljs.highlight(code, { language: lang, ignoreIllegals: true });
    return { html: result.value, className: languageClass(lang) };
  }
  // A named language we don't ship (mermaid, haskell, …): guessing another would miscolour it.
  return { html: escapeHtml(code), className: "hljs" };
}

function languageClass(language: string | undefined): string {
  return language ? `hljs language-${escapeHtml(language)}` : "hljs";
}

// --- Parser ---------------------------------------------------------------------------------

const md = new Marked(
  { gfm: true },
  // Supplies the $…$ / $$…$$ tokenizers; its renderers are overridden below.
  markedKatex(KATEX_OPTIONS),
  {
    extensions: [
      { name: "inlineKatex", renderer: (token) => (token as MathToken).placeholder ?? "" },
      { name: "blockKatex", renderer: (token) => ((token as MathToken).placeholder ?? "") + "\n" },
    ],
    renderer: {
      code({ text, lang }) {
        const { html, className } = highlight(text, lang ?? "");
        return `<pre><code class="${className}">${html}</code></pre>\n`;
      },
      // The app's CSP forbids remote content and a broken image helps nobody: show the alt text.
      image({ text }) {
        return escapeHtml(text);
      },
      // Raw HTML in worker output is shown as the text it is: a reply that quotes
      // `<img onerror=…>` or `<script>` reads the same as it was written, and runs nothing.
      html({ text }) {
        return escapeHtml(text);
      },
      // Task-list checkboxes would be live (if disabled) form controls; glyphs say the same.
      checkbox({ checked }) {
        return checked ? "☑ " : "☐ ";
      },
    },
  },
);

// --- Sanitizer ------------------------------------------------------------------------------

// A private instance: hooks registered on the default export would leak into every other
// DOMPurify user in the app.
const purify = DOMPurify(window);

// Everything marked emits plus harmless inline HTML models like to use (<br> in tables, <sub>,
// <details>). No forms, media, frames, scripts, styles, SVG or MathML.
const ALLOWED_TAGS = [
  "a", "abbr", "b", "blockquote", "br", "caption", "cite", "code", "dd", "del", "details",
  "div", "dl", "dt", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr", "i", "ins", "kbd", "li",
  "mark", "ol", "p", "pre", "q", "s", "samp", "small", "span", "strong", "sub", "summary", "sup",
  "table", "tbody", "td", "tfoot", "th", "thead", "tr", "u", "ul", "var",
];
// No `style` (a worker could overlay fake UI), no `id`/`name` (DOM clobbering), no `data-*`
// beyond the math placeholder (the app and its end-to-end tests select on data attributes).
const ALLOWED_ATTR = ["href", "title", "class", "align", "start", "colspan", "rowspan", "open", "data-math"];

// Worker HTML may only carry highlight.js classes, so it cannot borrow the app's own classes.
// highlight.js emits `hljs-*` scopes plus sub-scopes such as `function_`.
const ALLOWED_CLASS = /^(?:hljs(?:-[\w-]+)?|language-[\w+#.-]+|[a-z]+_+)$/;

// Links open outside the app, and only to the web or a mail client: relative and custom-scheme
// URLs would navigate the app's own webview.
const EXTERNAL_LINK = /^(?:https?|mailto):/i;

purify.addHook("uponSanitizeAttribute", (_node, data) => {
  if (data.attrName !== "class") return;
  const kept = data.attrValue.split(/\s+/).filter((name) => ALLOWED_CLASS.test(name));
  data.attrValue = kept.join(" ");
  data.keepAttr = kept.length > 0;
});

purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.tagName !== "A") return;
  const href = node.getAttribute("href");
  if (href === null) return;
  if (!EXTERNAL_LINK.test(href)) {
    node.removeAttribute("href");
    return;
  }
  node.setAttribute("target", "_blank");
  node.setAttribute("rel", "noopener noreferrer");
});

const SANITIZE_CONFIG: Config = {
  ALLOWED_TAGS,
  ALLOWED_ATTR,
  ALLOW_DATA_ATTR: false,
};

// --- Entry point ----------------------------------------------------------------------------

/**
 * Renders untrusted markdown to HTML that is safe for `{@html}`.
 *
 * Accepts any prefix of a document (an unclosed code fence, half a `$$` block) and never
 * throws. For text that streams in, `StreamingMarkdown` does the same work once per block.
 */
export function renderMarkdown(text: string): string {
  return renderTokens(() => md.lexer(text), true, text);
}

/**
 * Parses, sanitizes and typesets the tokens `lex` gives; `text` is shown raw if that fails.
 * Each call sanitizes its own output, so pieces rendered apart are as safe as a whole.
 */
function renderTokens(lex: () => Token[], guess: boolean, text: string): string {
  try {
    // The nonce makes placeholders unforgeable: worker HTML cannot name a slot it cannot guess.
    const nonce = crypto.randomUUID();
    const math: string[] = [];
    const tokens = lex();
    md.walkTokens(tokens, (token) => {
      if (!isMathToken(token)) return;
      token.placeholder = `<span data-math="${nonce}-${math.length}"></span>`;
      math.push(typeset(token.text, token.displayMode));
    });
    let html: string;
    guessLanguages = guess;
    try {
      html = md.parser(tokens);
    } finally {
      guessLanguages = true;
    }
    const clean = purify.sanitize(html, SANITIZE_CONFIG);
    // Serialization escapes quotes inside attribute values, so a placeholder that malformed
    // worker HTML swallowed into an attribute cannot match: only real placeholder elements do.
    const slot = new RegExp(`<span data-math="${nonce}-(\\d+)"></span>`, "g");
    return clean.replace(slot, (_, index: string) => math[Number(index)]);
  } catch (error) {
    // A rendering bug must not take the run view down with it; the raw text is still useful.
    console.error("markdown rendering failed", error);
    return `<pre>${escapeHtml(text)}</pre>`;
  }
}

// --- Streaming ------------------------------------------------------------------------------

/** Rendered HTML for part of a document; a new `id` comes with every new `html`. */
export interface RenderedBlock {
  id: number;
  html: string;
}

type Links = TokensList["links"];

/** Lexes `text` as the rest of a document whose earlier part defined `links`. */
function lexAfter(text: string, links: Links): TokensList {
  const lexer = new md.Lexer(md.defaults);
  // marked keeps the first definition of a label, as a lex of the whole document would.
  Object.assign(lexer.tokens.links, links);
  return lexer.lex(text);
}

function sameLinks(a: Links, b: Links): boolean {
  const keys = Object.keys(a);
  if (keys.length !== Object.keys(b).length) return false;
  return keys.every((k) => b[k] !== undefined && a[k].href === b[k].href && a[k].title === b[k].title);
}

// A display-math block (`$$` alone on its first line) may hold blank lines and other blocks
// before its closing `$$`; until that line arrives it lexes as ordinary blocks, which must stay
// open: the closing line turns them all into one formula.
const OPEN_MATH = /^\${1,2}\n/;

/**
 * Markdown that streams in, rendered incrementally: `update` takes the whole text so far and
 * returns the blocks to show. A top-level block is finished once the block after it has begun
 * on a complete line (a list or a fence can go on until then); finished blocks are rendered
 * once and kept, and only the open tail is rendered again. Code without a language is
 * highlighted by guessing only once finished, or once the text is final. The final blocks,
 * joined, are the HTML `renderMarkdown` gives for the whole text.
 */
export class StreamingMarkdown {
  /** The finished part of the text, rendered in `finished`. */
  private prefix = "";
  private finished: RenderedBlock[] = [];
  /** Link definitions inside the finished part, for lexing what follows it. */
  private definedBefore: Links = Object.create(null);
  /** Every link definition the finished blocks were rendered knowing. */
  private renderedWith: Links = Object.create(null);
  /** How far the text has been looked at for finished blocks (only complete lines count). */
  private checked = 0;
  private tail: { text: string; final: boolean; block: RenderedBlock } | null = null;
  private nextId = 0;

  /** The blocks for `text`, the whole text so far; `final`: no more will come. */
  update(text: string, final = false): RenderedBlock[] {
    if (!text.startsWith(this.prefix)) this.reset();
    // Only complete lines decide what is finished: half a line can lex as a block that its
    // next characters undo (a table's delimiter row, a `$$` that is not a line of its own).
    const complete = text.lastIndexOf("\n") + 1;
    if (!final && complete > this.checked) this.finishBlocks(text.slice(0, complete));

    const rest = text.slice(this.prefix.length);
    if (this.tail?.text !== rest || this.tail.final !== final) {
      let links: Links = this.definedBefore;
      const html = renderTokens(
        () => {
          const tokens = lexAfter(rest, this.definedBefore);
          links = tokens.links;
          return tokens;
        },
        final,
        rest,
      );
      if (final && this.finished.length > 0 && !sameLinks(this.renderedWith, links)) {
        // A link defined further on changes how the finished blocks read. Rare: render the
        // whole text again, as one block.
        const whole = { id: this.nextId++, html: renderMarkdown(text) };
        this.reset();
        this.prefix = text;
        this.finished = [whole];
        this.tail = { text: "", final, block: { id: this.nextId++, html: "" } };
      } else {
        this.tail = { text: rest, final, block: { id: this.nextId++, html } };
      }
    }
    return this.tail.text === "" ? [...this.finished] : [...this.finished, this.tail.block];
  }

  private reset(): void {
    this.prefix = "";
    this.finished = [];
    this.definedBefore = Object.create(null);
    this.renderedWith = Object.create(null);
    this.checked = 0;
    this.tail = null;
  }

  /** Moves the blocks of `text` (complete lines) that can no longer change into `finished`. */
  private finishBlocks(text: string): void {
    let tokens = lexAfter(text.slice(this.prefix.length), this.definedBefore);
    // A new link definition may change blocks already rendered: start over from the top.
    const learned = Object.keys(tokens.links).some((k) => this.renderedWith[k] === undefined);
    if (learned && this.finished.length > 0) {
      this.reset();
      tokens = lexAfter(text, this.definedBefore);
    }
    this.checked = text.length;
    const start = this.prefix.length;
    const source = text.slice(start);
    // Everything before the last block that has begun is finished, up to an open `$$`.
    let open = tokens.length;
    while (open > 0 && tokens[open - 1].type === "space") open--;
    open--;
    let length = 0;
    let count = 0;
    for (; count < open; count++) {
      const token = tokens[count];
      if (token.type !== "blockKatex" && OPEN_MATH.test(token.raw)) break;
      // A token's raw text is the source as written; should it ever not be, stop there rather
      // than lose or repeat text.
      if (!source.startsWith(token.raw, length)) break;
      length += token.raw.length;
    }
    // The links the lexer knew are what the blocks rendered now were lexed with; the next
    // pass compares against them.
    Object.assign(this.renderedWith, tokens.links);
    if (count === 0) return;
    const done = tokens.slice(0, count);
    const html = renderTokens(() => done, true, source.slice(0, length));
    this.prefix = text.slice(0, start + length);
    this.finished.push({ id: this.nextId++, html });
    for (const token of done) {
      if (token.type === "def" && this.definedBefore[token.tag] === undefined) {
        this.definedBefore[token.tag] = { href: token.href, title: token.title };
      }
    }
  }
}
