import { describe, expect, it, vi } from "vitest";
import { escapeHtml, renderMarkdown } from "./markdown";

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

describe("escapeHtml", () => {
  it("escapes the five HTML-significant characters", () => {
    expect(escapeHtml(`<a href="x">'&'</a>`)).toBe("&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
  });

  it("leaves other text alone", () => {
    expect(escapeHtml("plain text, ünïcode ∑")).toBe("plain text, ünïcode ∑");
  });
});
