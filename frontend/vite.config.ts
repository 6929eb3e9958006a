import { resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { defineConfig } from "vite";

const here = fileURLToPath(new URL(".", import.meta.url));

// One entry per page family. Stable file names (no content hashes) so Django templates
// can reference them with {% static %}; whitenoise serves them, and cache busting comes
// from collectstatic's manifest in production.
export default defineConfig({
  base: "/static/dist/",
  publicDir: false,
  build: {
    outDir: resolve(here, "static/dist"),
    // Overwrite in place: `make test` rebuilds while other runs may be serving these files.
    emptyOutDir: false,
    sourcemap: true,
    target: "es2020",
    rollupOptions: {
      // htmx evaluates hx-on/js: attributes by design; we use neither, and the warning
      // would print on every build.
      onwarn(warning, warn) {
        if (warning.code === "EVAL" && warning.id?.includes("htmx.org")) return;
        warn(warning);
      },
      input: {
        main: resolve(here, "src/main.ts"),
        sandbox: resolve(here, "src/sandbox.ts"),
        charts: resolve(here, "src/charts.ts"),
        images: resolve(here, "src/images.ts"),
      },
      output: {
        entryFileNames: "[name].js",
        chunkFileNames: "chunks/[name].js",
        assetFileNames: "[name][extname]",
      },
    },
  },
});
