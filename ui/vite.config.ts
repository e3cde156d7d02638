import { defineConfig } from "vite";
import { svelte } from "@sveltejs/vite-plugin-svelte";

// The desktop shell loads the built files from ui/dist (embedded in the binary); `npm run dev`
// serves them on a fixed port for `tauri dev`.
export default defineConfig({
  plugins: [svelte()],
  clearScreen: false,
  server: { port: 1420, strictPort: true },
  build: { target: "safari16", outDir: "dist", emptyOutDir: true, chunkSizeWarningLimit: 2000 },
  test: { environment: "jsdom", include: ["src/**/*.test.ts"] },
});
