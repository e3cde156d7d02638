import { describe, expect, it, vi } from "vitest";
import hljs from "highlight.js/lib/core";
import { escapeHtml, renderMarkdown, StreamingMarkdown, type RenderedBlock } from "./markdown";

/** Parses the rendered HTML into an inert document (DOMParser never runs scripts). */
function render(markdown: string): HTMLElement {
  return new DOMParser().parseFromString(`<body>${renderMarkdown(markdown)}</body>`, "text/html").body;
}

const DANGEROUS_ELEMENTS = "script, iframe, frame, object, embed, img, style, link, meta, base, form, input, button, textarea, select";
const URL_ATTRIBUTES = ["href", "src", "xlink:href", "action", "formaction"];

/** Fails unless nothing in `root` can run code, load content or restyle the page. */
function expectInert(root: HTMLElement): void {
  expect(root.querySelectorAll(DANGEROUS_ELEMENTS)).toHaveLength(0);
  for (const el of root.querySelectorAll("*")) {
    for (const attr of el.attributes) {
      expect(attr.name, `<${el.localName} ${attr.name}>`).not.toMatch(/^on/i);
      if (URL_ATTRIBUTES.includes(attr.name)) {
        expect(attr.value, `<${el.localName} ${attr.name}>`).not.toMatch(/^\s*(?:javascript|data|vbscript):/i);
      }
    }
    // Inline styles are KaTeX's alone; worker HTML could use them to overlay fake UI.
    if (el.hasAttribute("style")) expect(el.closest(".katex, .katex-error"), `<${el.localName} style>`).not.toBeNull();
  }
}

describe("renderMarkdown: untrusted HTML", () => {
  const payloads = [
    "<img src=x onerror=alert(1)>",
    "<script>alert(1)</script>",
    '<a href="https://example.com" onclick="alert(1)">site</a>',
    "<svg onload=alert(1)><circle r=5 /></svg>",
    '<iframe src="https://example.com"></iframe>',
    "<object data=x></object><embed src=x>",
    "<style>body { display: none }</style>",
    '<form action="https://example.com"><input name=q><button formaction="javascript:alert(1)">go</button></form>',
    '<div onmouseover="alert(1)" style="position:fixed;inset:0">overlay</div>',
    "<math><mi xlink:href=\"javascript:alert(1)\">x</mi></math>",
  ];

  it.each(payloads)("renders %s inert", (payload) => {
    expectInert(render(payload));
  });

  it.each(payloads)("keeps %s literal inside inline code", (payload) => {
    const body = render(`Try \`${payload}\` here.`);
    expectInert(body);
    expect(body.querySelector("code")?.textContent).toBe(payload);
  });

  it("keeps payloads literal inside a fenced block", () => {
    const payload = '<img src=x onerror=alert(1)>\n<script>alert("x")</script>';
    const body = render("```html\n" + payload + "\n```");
    expectInert(body);
    expect(body.querySelector("pre code")?.textContent).toBe(payload);
  });

  it("drops <img> and <svg> elements", () => {
    const body = render("before <img src=x onerror=alert(1)> <svg onload=alert(1)></svg> after");
    expect(body.querySelector("img, svg")).toBeNull();
    expect(body.textContent).toContain("before");
    expect(body.textContent).toContain("after");
  });

  it("shows a script tag as the text it is, and runs nothing", () => {
    const body = render("<script>alert(1)</script>\n\nvisible");
    expect(body.querySelector("script")).toBeNull();
    expect(body.textContent).toContain("<script>alert(1)</script>");
    expect(body.textContent).toContain("visible");
  });

  it("shows raw HTML links as text; markdown links open outside the app", () => {
    const raw = render('<a href="https://example.com" onclick="alert(1)">site</a>');
    expect(raw.querySelector("a")).toBeNull();
    expect(raw.textContent).toContain('onclick="alert(1)"');
    const a = render("[site](https://example.com)").querySelector("a");
    expect(a?.getAttribute("href")).toBe("https://example.com");
    expect(a?.hasAttribute("onclick")).toBe(false);
    expect(a?.getAttribute("target")).toBe("_blank");
    expect(a?.getAttribute("rel")).toBe("noopener noreferrer");
    expect(a?.textContent).toBe("site");
  });

  it("removes style attributes from worker HTML but keeps the text", () => {
    const body = render('<span style="position:fixed;inset:0">overlay</span>');
    expectInert(body);
    expect(body.querySelector("[style]")).toBeNull();
    expect(body.textContent).toContain("overlay");
  });

  it("never lets worker HTML borrow the app's classes", () => {
    const body = render('<div class="modal hljs-keyword danger">x</div>');
    expect(body.querySelector(".modal, .danger")).toBeNull();
    expect(body.textContent).toContain('<div class="modal hljs-keyword danger">x</div>');
  });

  it("removes id and data attributes the app could be confused by", () => {
    const body = render('<div id="app" data-testid="plan-run" data-math="x">x</div>');
    expect(body.querySelector("#app, [data-testid]")).toBeNull();
  });
});

describe("renderMarkdown: links", () => {
  it.each([
    "[x](javascript:alert(1))",
    "[x](JaVaScRiPt:alert(1))",
    "[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
    "[x](vbscript:msgbox)",
  ])("drops the href of %s but keeps the text", (markdown) => {
    const body = render(markdown);
    expectInert(body);
    const a = body.querySelector("a");
    expect(a?.hasAttribute("href")).toBe(false);
    expect(a?.textContent).toBe("x");
  });

  it("drops relative and custom-scheme links, which would navigate the app itself", () => {
    for (const href of ["/settings", "../x", "//example.com", "tauri://localhost", "file:///etc/passwd"]) {
      const a = render(`[x](${href})`).querySelector("a");
      expect(a?.hasAttribute("href"), href).toBe(false);
    }
  });

  it("opens web and mail links outside the app", () => {
    for (const href of ["https://example.com/a?b=c", "http://example.com", "mailto:a@example.com"]) {
      const a = render(`[x](${href})`).querySelector("a");
      expect(a?.getAttribute("href")).toBe(href);
      expect(a?.getAttribute("target")).toBe("_blank");
      expect(a?.getAttribute("rel")).toBe("noopener noreferrer");
    }
  });

  it("shows a markdown image as its alt text", () => {
    const body = render("![a cat on a mat](https://example.com/cat.png)");
    expect(body.querySelector("img")).toBeNull();
    expect(body.textContent?.trim()).toBe("a cat on a mat");
  });
});

describe("renderMarkdown: markdown features", () => {
  it("renders GFM tables and task lists without form controls", () => {
    const body = render("| a | b |\n|:--|--:|\n| 1 | 2 |\n\n- [x] done\n- [ ] todo");
    expect(body.querySelectorAll("table td")).toHaveLength(2);
    expect(body.querySelector("td")?.getAttribute("align")).toBe("left");
    expect(body.querySelector("input")).toBeNull();
    expect([...body.querySelectorAll("li")].map((li) => li.textContent)).toEqual(["☑ done", "☐ todo"]);
  });

  it("highlights a fenced block in a named language", () => {
    const code = render("```python\ndef f(x):\n    return x\n```").querySelector("pre code");
    expect(code?.classList.contains("hljs")).toBe(true);
    expect(code?.classList.contains("language-python")).toBe(true);
    expect(code?.querySelector(".hljs-keyword")?.textContent).toBe("def");
    expect(code?.textContent).toBe("def f(x):\n    return x");
  });

  it("auto-detects the language of an unlabelled fence", () => {
    const code = render('```\n{"name": "baton", "steps": [1, 2], "ok": true}\n```').querySelector("pre code");
    expect(code?.classList.contains("hljs")).toBe(true);
    expect(code?.className).toMatch(/language-\w+/);
    expect(code?.querySelector("[class^='hljs-']")).not.toBeNull();
  });

  it("leaves a fence in an unknown language escaped and uncoloured", () => {
    const code = render("```mermaid\ngraph TD; A-->B\n```").querySelector("pre code");
    expect(code?.className).toBe("hljs");
    expect(code?.children).toHaveLength(0);
    expect(code?.textContent).toBe("graph TD; A-->B");
  });

  it("does not let a fence's info string inject attributes", () => {
    const body = render('```x"onmouseover="alert(1)\ncode\n```');
    expectInert(body);
    expect(body.querySelector("code")?.textContent).toBe("code");
  });
});

describe("renderMarkdown: math", () => {
  it("typesets inline $…$ with KaTeX", () => {
    const body = render("Energy is $x^2$ here.");
    const math = body.querySelector("p > .katex");
    expect(math).not.toBeNull();
    expect(math?.querySelector(".katex-html")).not.toBeNull();
    expect(math?.querySelector("annotation")?.textContent).toBe("x^2");
    expect(body.querySelector(".katex-display")).toBeNull();
  });

  it("typesets display $$…$$ blocks", () => {
    const body = render("$$\n\\frac{a}{b}\n$$");
    expect(body.querySelector(".katex-display .katex annotation")?.textContent).toBe("\\frac{a}{b}");
  });

  it("keeps math inside code literal", () => {
    const body = render("`$x^2$`");
    expect(body.querySelector(".katex")).toBeNull();
    expect(body.querySelector("code")?.textContent).toBe("$x^2$");
  });

  it("shows broken TeX as a KaTeX error instead of throwing", () => {
    const body = render("bad $\\frac{1}{$ math");
    expect(body.querySelector(".katex-error")).not.toBeNull();
  });

  it("keeps TeX payloads inert", () => {
    for (const tex of ["\\href{javascript:alert(1)}{x}", "<img src=x onerror=alert(1)>", "\\htmlStyle{position:fixed}{x}", "\\url{javascript:alert(1)}"]) {
      const body = render(`$${tex}$`);
      expectInert(body);
      expect(body.querySelector("a[href]"), tex).toBeNull();
    }
  });

  it("keeps malformed HTML around math as text", () => {
    const body = render('<div title="\n\nfoo $x$ bar"');
    expectInert(body);
    expect(body.querySelector("div[title]")).toBeNull();
    expect(body.textContent).toContain('<div title="');
  });
});

describe("renderMarkdown: streaming", () => {
  const document = [
    "# R\n\n**b** `c` $a+b$\n\n",
    "```ts\nlet x = `${1}`;\n```\n\n",
    "$$\n\\frac{n}{2}\n$$\n\n",
    "| a |\n|---|\n| $y$ <br> |\n\n",
    '<a href="https://e.com" onclick="alert(1)">x</a><img src=x onerror=alert(1)>\n\n',
    "[l](javascript:alert(1)) ![i](https://e.com/i.png)\n",
  ].join("");

  // Hundreds of renders, and DOMPurify on jsdom is far slower than in a browser.
  it("renders every prefix of a document without throwing and stays inert", { timeout: 30_000 }, () => {
    // renderMarkdown falls back to escaped text (and logs) when the pipeline throws; that
    // fallback must stay unused.
    const logged = vi.spyOn(console, "error");
    try {
      for (let end = 0; end <= document.length; end++) {
        const prefix = document.slice(0, end);
        expectInert(render(prefix));
        expect(logged, JSON.stringify(prefix)).not.toHaveBeenCalled();
      }
    } finally {
      logged.mockRestore();
    }
  });

  it("renders an unclosed code fence as code", () => {
    const code = render("```js\nconst x = 1;").querySelector("pre code");
    expect(code?.classList.contains("language-js")).toBe(true);
    expect(code?.textContent).toBe("const x = 1;");
  });

  it("shows half a $$ block as text", () => {
    const body = render("$$\n\\frac{1}{2");
    expect(body.querySelector(".katex")).toBeNull();
    expect(body.textContent).toContain("\\frac{1}{2");
  });

  it("renders empty input as nothing", () => {
    expect(renderMarkdown("")).toBe("");
  });
});

describe("StreamingMarkdown", () => {
  // Documents with the blocks that only end when the next one begins (lists, fences, tables,
  // paragraphs with lazy lines), blocks that merge when a later line arrives (setext headings,
  // display math with blank lines inside), raw HTML, link definitions after their use, and a
  // fence that is never closed.
  const DOCUMENTS: Record<string, string> = {
    fences: [
      "Intro with `code`.",
      "",
      "```python",
      "def f(x):",
      "",
      "    # - not a list",
      "    return x  # ```not the end",
      "```",
      "```",
      "no language { here: 1 } <b>x</b>",
      "",
      "SELECT * FROM t;",
      "```",
      "~~~rust",
      "fn main() {}",
      "~~~",
      "    indented code",
      "",
      "    more of it",
      "after",
      "",
    ].join("\n"),
    lists: [
      "- one",
      "- two",
      "  - nested **bold**",
      "    1. deeper",
      "    2. deeper still",
      "",
      "  still item two, after a blank line",
      "- three",
      "lazy line of three",
      "",
      "1. first",
      "",
      "2. loose second",
      "",
      "10) other marker",
      "",
      "* [ ] task",
      "* [x] done",
      "",
      "Paragraph after.",
      "",
    ].join("\n"),
    tables: [
      "Text right before a table",
      "| a | b |",
      "|---|:-:|",
      "| 1 | **2** |",
      "| 3 | $x^2$ |",
      "| pipe \\| inside | `c|d` |",
      "",
      "| only header |",
      "not a delimiter row",
      "",
      "| h |",
      "|---|",
      "row without pipes",
      "",
    ].join("\n"),
    math: [
      "Inline $a+b$ and $$c$$ here.",
      "",
      "$$",
      "\\int_0^1 x\\,dx",
      "$$",
      "",
      "$$",
      "x = 1",
      "",
      "- looks like a list",
      "",
      "y = 2",
      "$$",
      "",
      "$",
      "single dollar block",
      "$",
      "",
      "$$ not alone on its line",
      "",
      "Cost is $5 and $6.",
      "",
    ].join("\n"),
    html: [
      "<div onclick=\"alert(1)\">",
      "*inside a div*",
      "</div>",
      "",
      "<script>alert(1)",
      "",
      "still script</script>",
      "<!-- a comment",
      "",
      "over lines -->",
      "Text <img src=x onerror=alert(1)> and <b>bold</b>.",
      "",
      "<pre>",
      "",
      "pre text",
      "</pre>",
      "",
    ].join("\n"),
    headings: [
      "Title",
      "=====",
      "",
      "Sub",
      "and more",
      "---",
      "",
      "# ATX #",
      "> quote",
      "lazy quote line",
      "",
      "> - list in quote",
      ">",
      "> ```",
      "> code in quote",
      "> ```",
      "",
      "***",
      "",
    ].join("\n"),
    links: [
      "See [the site][site] and [other].",
      "",
      "- [in a list][site]",
      "",
      "[site]: https://example.com \"Title\"",
      "",
      "Then <https://auto.example> and https://bare.example.",
      "",
      "[other]: https://other.example",
      "",
      "[site]: https://second.example",
      "",
    ].join("\n"),
    unclosed: ["Before.", "", "```js", "const a = 1;", "", "const b = [", "  2,"].join("\n"),
    long: longAnswer(60),
  };

  /** Like the test server's `lines=N` answer: paragraphs, lists, tables, code with and without a language. */
  function longAnswer(n: number): string {
    const lines: string[] = [];
    for (let b = 0; lines.length < n; b++) {
      const at = (k: number) => `(line ${lines.length + k})`;
      const blocks = [
        [`Part ${b} ${at(0)} explains **why** and \`value_${b}\``, `goes on ${at(1)} with *care*.`],
        [`- first ${at(0)}`, `  - nested ${at(1)}`, `- second ${at(2)}`],
        ["```python", `def part_${b}(v):  # ${at(1)}`, `    return v * ${b}`, "```"],
        [`| part | note ${at(0)} |`, "|---:|---|", `| ${b} | row ${at(2)} |`],
        ["```", `let total_${b} = ${b}; // ${at(1)}`, `SELECT ${b}; -- ${at(2)}`, "```"],
        [`1. check ${at(0)}`, `2. run ${at(1)}`],
      ];
      lines.push(...blocks[b % blocks.length], "");
    }
    return lines.slice(0, n).join("\n") + "\n";
  }

  /** A small deterministic random source (mulberry32), so a failure names its seed. */
  function random(seed: number): () => number {
    return () => {
      seed = (seed + 0x6d2b79f5) | 0;
      let t = Math.imul(seed ^ (seed >>> 15), 1 | seed);
      t = (t + Math.imul(t ^ (t >>> 7), 61 | t)) ^ t;
      return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
  }

  /** `text` cut into pieces of 1 to `max` characters, or whole lines, as a stream might send it. */
  function chunks(text: string, seed: number): string[] {
    const next = random(seed);
    const byLine = seed % 3 === 0;
    const max = [1, 3, 12, 40][seed % 4];
    const out: string[] = [];
    for (let at = 0; at < text.length; ) {
      let end = at + 1 + Math.floor(next() * max);
      if (byLine) end = text.indexOf("\n", at) + 1 || text.length;
      out.push(text.slice(at, end));
      at = end;
    }
    return out;
  }

  const joined = (blocks: RenderedBlock[]) => blocks.map((b) => b.html).join("");
  // The same DOM written the same way: DOMPurify returns text without a tag as it came (`&quot;`
  // stays), while inside markup it writes `"`.
  const normal = (html: string) => new DOMParser().parseFromString(`<body>${html}</body>`, "text/html").body.innerHTML;
  const textOf = (html: string) =>
    new DOMParser().parseFromString(`<body>${html}</body>`, "text/html").body.textContent;

  /** Streams `text` in `pieces`; calls `check` with the text so far and the blocks after each. */
  function stream(pieces: string[], check?: (sofar: string, blocks: RenderedBlock[]) => void): StreamingMarkdown {
    const renderer = new StreamingMarkdown();
    let sofar = "";
    for (const piece of pieces) {
      sofar += piece;
      const blocks = renderer.update(sofar);
      check?.(sofar, blocks);
    }
    return renderer;
  }

  // jsdom's DOMPurify is slow; these render thousands of prefixes.
  describe.each(Object.entries(DOCUMENTS))("%s", (_, text) => {
    it("ends as the whole text rendered at once, however it was cut", { timeout: 60_000 }, () => {
      const whole = renderMarkdown(text);
      for (let seed = 1; seed <= 8; seed++) {
        const renderer = stream(chunks(text, seed));
        expect(normal(joined(renderer.update(text, true))), `seed ${seed}`).toBe(normal(whole));
      }
    });

    it("shows the same text as the prefix rendered at once, at every step", { timeout: 60_000 }, () => {
      for (const seed of [2, 7]) {
        stream(chunks(text, seed), (sofar, blocks) => {
          // Link definitions further on may still change how earlier blocks read.
          if (text !== DOCUMENTS.links) expect(textOf(joined(blocks)), JSON.stringify(sofar)).toBe(textOf(renderMarkdown(sofar)));
          expectInert(new DOMParser().parseFromString(`<body>${joined(blocks)}</body>`, "text/html").body);
        });
      }
    });
  });

  it("renders finished blocks once and keeps them", () => {
    const text = longAnswer(150);
    const seen = new Map<number, string>();
    let finishedSeen = 0;
    const renderer = stream(chunks(text, 3), (_, blocks) => {
      for (const block of blocks.slice(0, -1)) {
        const html = seen.get(block.id);
        if (html === undefined) finishedSeen++;
        else expect(block.html).toBe(html);
        seen.set(block.id, block.html);
      }
    });
    // Blocks are finished as the stream goes, not at its end.
    expect(finishedSeen).toBeGreaterThan(20);
    const final = renderer.update(text, true);
    expect(final.slice(0, -1).every((b) => seen.get(b.id) === b.html)).toBe(true);
  });

  it("guesses the language of a block without one only once it is finished", () => {
    const text = longAnswer(150);
    // Fences without a language: every other bare ``` line opens one (the others close).
    let fences = 0;
    let open = false;
    for (const line of text.split("\n")) {
      if (!line.startsWith("```")) continue;
      if (!open && line === "```") fences++;
      open = !open;
    }
    expect(fences).toBeGreaterThan(3);
    const guessed = vi.spyOn(hljs, "highlightAuto");
    try {
      const renderer = stream(chunks(text, 1));
      // The last block is a list, so every unlabelled fence finished during the stream.
      expect(guessed).toHaveBeenCalledTimes(fences);
      renderer.update(text, true);
      expect(guessed).toHaveBeenCalledTimes(fences);
    } finally {
      guessed.mockRestore();
    }
  });

  it("highlights a block with a language while it is still open", () => {
    const renderer = new StreamingMarkdown();
    const code = "```python\ndef f():\n    return 1\n";
    const body = new DOMParser().parseFromString(joined(renderer.update(code)), "text/html").body;
    expect(body.querySelector("code.language-python .hljs-keyword")?.textContent).toBe("def");
    // Without a language it stays plain until finished.
    const plain = new DOMParser().parseFromString(joined(renderer.update("```\ndef f():\n")), "text/html").body;
    expect(plain.querySelector("code")?.innerHTML).toBe("def f():");
  });

  it("starts over when the text is replaced rather than extended", () => {
    const renderer = new StreamingMarkdown();
    renderer.update("first attempt\n\nwith two paragraphs\n\n");
    expect(joined(renderer.update("second\n", true))).toBe(renderMarkdown("second\n"));
    expect(renderer.update("", true)).toEqual([]);
  });

  it("shows raw HTML as text while it streams", () => {
    const payload = "<img src=x onerror=alert(1)>\n\n<script>alert(1)</script>\n\ndone\n";
    stream(chunks(payload, 5), (_, blocks) => {
      const body = new DOMParser().parseFromString(`<body>${joined(blocks)}</body>`, "text/html").body;
      expectInert(body);
    });
    const body = new DOMParser().parseFromString(joined(stream([payload]).update(payload, true)), "text/html").body;
    expect(body.textContent).toContain("<img src=x onerror=alert(1)>");
    expect(body.textContent).toContain("<script>alert(1)</script>");
  });
});

describe("escapeHtml", () => {
  it("escapes the five HTML-significant characters", () => {
    expect(escapeHtml(`<a href="x">'&'</a>`)).toBe("&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
  });

  it("leaves other text alone", () => {
    expect(escapeHtml("plain text, ünïcode ∑")).toBe("plain text, ünïcode ∑");
  });
});
