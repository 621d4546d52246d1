// Swagger UI over this server's OpenAPI document. With --api-key on, it sends the key that the
// logprobs page keeps in this origin's storage, for the document and for "Try it out".
"use strict";

(async () => {
  const key = localStorage.getItem("omlx_logprobs.api_key") || "";
  const config = await (await fetch("/page/config")).json();
  if (config.api_key_required && !key) {
    const note = document.getElementById("docs-note");
    note.innerHTML = 'This server needs an API key. Enter it once on <a href="/">the logprobs ' +
      "page</a>; this reference then uses it too.";
    note.hidden = false;
    return;
  }
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null, // no badge that sends the document to an online validator
    requestInterceptor: (req) => {
      if (key && !req.headers.Authorization) req.headers.Authorization = "Bearer " + key;
      return req;
    },
  });
})();
