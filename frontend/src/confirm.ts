// The page's one accessible confirmation <dialog> (#confirm-dialog in base.html), as a
// promise: forms with data-confirm use it (main.ts), and so does code that must ask
// before acting (the file browser before replacing a file).

export function confirmDialog(message: string): Promise<boolean> {
  const dialog = document.querySelector<HTMLDialogElement>("#confirm-dialog");
  if (!dialog) return Promise.resolve(window.confirm(message));
  dialog.querySelector(".confirm-message")!.textContent = message;
  dialog.returnValue = "";
  dialog.showModal();
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "confirm"), { once: true });
  });
}
