"""The HTML report's stylesheet and script (inline: the file opens offline). Pure data.

Every CSS rule is scoped to ``.cw-report`` so a notebook page's own styles and the report's do
not mix; the script works on one report element (``__ROOT__`` is replaced by its id).
"""

from __future__ import annotations

CSS = """
.cw-report{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--bg:#fff;--panel:#f6f8fa;--err:#cf222e;--warn:#9a6700;
--info:#0969da;--sel:#fff8c5;--path:#ddf4ff;
font:14px/1.45 system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;color:var(--fg);background:var(--bg);
max-width:1280px;margin:0 auto;padding:12px 16px}
.cw-report h1{font-size:20px;margin:4px 0 8px}.cw-report h2{font-size:17px;margin:20px 0 8px;
border-bottom:1px solid var(--line);padding-bottom:4px}.cw-report h3{font-size:14px;margin:14px 0 4px}
.cw-report code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.cw-report .cw-tally span{display:inline-block;border-radius:10px;padding:1px 9px;margin-right:6px;font-weight:600;
color:#fff}.cw-report .cw-tally .cw-t-error{background:var(--err)}
.cw-report .cw-tally .cw-t-warning{background:var(--warn)}
.cw-report .cw-tally .cw-t-info{background:var(--info)}.cw-report .cw-tally .cw-t-none{background:#1a7f37}
.cw-report .cw-meta{color:var(--muted);margin:6px 0}.cw-report .cw-policy{background:var(--panel);
border:1px solid var(--line);border-radius:6px;padding:6px 10px;margin:8px 0}
.cw-report nav a{margin-right:14px;color:var(--info);text-decoration:none}
.cw-report .cw-findings{list-style:none;padding:0;margin:0}
.cw-report .cw-finding{border:1px solid var(--line);border-left:4px solid var(--info);border-radius:6px;
padding:6px 10px;margin:6px 0;background:var(--bg)}
.cw-report .cw-finding[role=button]{cursor:pointer}.cw-report .cw-finding:focus{outline:2px solid var(--info)}
.cw-report .cw-sev-error{border-left-color:var(--err)}.cw-report .cw-sev-warning{border-left-color:var(--warn)}
.cw-report .cw-finding.cw-selected{background:var(--sel)}
.cw-report .cw-sev{font-weight:700;text-transform:uppercase;font-size:11px}
.cw-report .cw-sev-error .cw-sev{color:var(--err)}.cw-report .cw-sev-warning .cw-sev{color:var(--warn)}
.cw-report .cw-finding dl{display:grid;grid-template-columns:70px 1fr;gap:2px 8px;margin:4px 0}
.cw-report .cw-finding dt{color:var(--muted)}.cw-report .cw-finding dd{margin:0}
.cw-report .cw-trail{font-size:12.5px}.cw-report .cw-trail-label{color:var(--muted);margin-right:4px}
.cw-report .cw-step{font-family:ui-monospace,Menlo,Consolas,monospace;background:var(--path);border-radius:4px;
padding:0 4px}.cw-report .cw-step-origin{background:#ffebe9;font-weight:600}
.cw-report .cw-step-at{background:#ffd8b5;font-weight:600}
.cw-report .cw-toolbar{display:flex;gap:8px;align-items:center;flex-wrap:wrap;margin:6px 0}
.cw-report .cw-toolbar input{flex:1;min-width:220px;padding:5px 8px;border:1px solid var(--line);border-radius:6px}
.cw-report button{font:inherit;font-size:12px;border:1px solid var(--line);background:var(--panel);border-radius:6px;
padding:2px 8px;cursor:pointer}
.cw-report .cw-pathbar{font-size:12.5px;min-height:18px;color:var(--muted)}
.cw-report .cw-tree{font-size:13px;border:1px solid var(--line);border-radius:6px;padding:6px;max-height:70vh;
overflow:auto}
.cw-report .cw-node{margin-left:14px}.cw-report .cw-tree>.cw-node{margin-left:0}
.cw-report .cw-leaf>.cw-row{padding-left:14px}
.cw-report .cw-row{padding:1px 4px;border-radius:4px;white-space:nowrap}
.cw-report summary.cw-row{cursor:pointer}
.cw-report .cw-name{font-family:ui-monospace,Menlo,Consolas,monospace;font-weight:600}
.cw-report .cw-type{color:var(--muted)}
.cw-report .cw-dt{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:11.5px;border-radius:3px;
padding:0 3px;color:#fff}
.cw-report .cw-k-f32{background:#4e79a7}.cw-report .cw-k-bf16{background:#2f8f46}
.cw-report .cw-k-f16{background:#e07b00}
.cw-report .cw-k-f64{background:#8a5a9e}.cw-report .cw-k-f8e4m3fn,.cw-report .cw-k-f8e5m2{background:#9c755f}
.cw-report .cw-dt.cw-k-other,.cw-report .cw-dt[class*=cw-k-i],.cw-report .cw-dt[class*=cw-k-u],
.cw-report .cw-dt.cw-k-b8{background:#8c959f}
.cw-report .cw-params{margin-left:4px}.cw-report .cw-io{margin-left:6px}
.cw-report .cw-flag{font-size:11px;border:1px solid var(--line);border-radius:8px;padding:0 6px;margin-left:4px;
color:var(--muted)}
.cw-report .cw-flag-upcast{background:#fff1e5;border-color:#e07b00;color:#8a4600;font-weight:600}
.cw-report .cw-flag-cast{background:#eef4ff;border-color:#4e79a7;color:#204a87}
.cw-report .cw-flag-raised{background:#ffebe9;border-color:var(--err);color:var(--err);font-weight:600}
.cw-report .cw-row.cw-upcast{background:#fff1e5}.cw-report .cw-row.cw-raised{background:#ffebe9}
.cw-report .cw-pin{background:#ffebe9;border-color:var(--err);color:var(--err);font-size:11px;padding:0 6px;
margin-left:4px}.cw-report .cw-pin-origin{background:#fff;border-style:dashed}
.cw-report .cw-row.cw-on-path{background:var(--path)}
.cw-report .cw-row.cw-is-origin{background:#ffebe9;outline:2px solid var(--err)}
.cw-report .cw-row.cw-is-at{background:#ffd8b5;outline:2px solid #e07b00}
.cw-report .cw-hit>.cw-row .cw-name,.cw-report .cw-row.cw-hit .cw-name{background:var(--sel)}
.cw-report .cw-legend{font-size:12px;color:var(--muted)}
.cw-report .cw-chart{display:block;max-width:100%;height:auto;margin:4px 0}
.cw-report .cw-chart text{font:11px ui-monospace,Menlo,Consolas,monospace;fill:var(--fg)}
.cw-report .cw-chart .cw-tick{fill:var(--muted)}.cw-report .cw-grid{stroke:#eaeef2}
.cw-report .cw-bar{fill:#4e79a7}.cw-report .cw-bar.cw-k-bf16{fill:#2f8f46}.cw-report .cw-bar.cw-k-f16{fill:#e07b00}
.cw-report .cw-bar.cw-k-f64{fill:#8a5a9e}.cw-report .cw-bar.cw-k-ok{fill:#6e9bc5}
.cw-report .cw-bar.cw-k-warn{fill:#d4a72c}.cw-report .cw-bar.cw-k-bad{fill:var(--err)}
.cw-report .cw-bar-inner{fill:#1f2328;opacity:.45}.cw-report .cw-marker{stroke:#1f2328;stroke-width:2}
.cw-report .cw-callout{border-left:4px solid var(--err);background:#ffebe9;padding:6px 10px;border-radius:4px}
.cw-report .cw-table{border-collapse:collapse;font-size:12px}.cw-report .cw-table td,.cw-report .cw-table th{
border:1px solid var(--line);padding:2px 6px;text-align:right}.cw-report .cw-table td:first-child{text-align:left;
font-family:ui-monospace,Menlo,Consolas,monospace}
.cw-report .cw-none{color:var(--muted)}
"""

JS = """
(function(){
var root=document.getElementById("__ROOT__");if(!root)return;
var nodes=Array.prototype.slice.call(root.querySelectorAll(".cw-node"));var byName={};
nodes.forEach(function(n){byName[n.getAttribute("data-node")]=n;});
function rowOf(n){return n.tagName==="DETAILS"?n.querySelector(":scope>summary"):n.querySelector(":scope>.cw-row");}
function parentOf(name){var p=name.split(".");while(p.length>1){p.pop();var c=p.join(".");if(byName[c])return c;}
return "";}
function reveal(name){var n=byName[name];var guard=0;while(n&&guard++<4096){n.hidden=false;
var up=n.parentElement&&n.parentElement.closest(".cw-node");if(up&&up.tagName==="DETAILS")up.open=true;n=up;}}
var findings=Array.prototype.slice.call(root.querySelectorAll(".cw-finding"));
var bar=root.querySelector(".cw-pathbar");
function clear(){root.querySelectorAll(".cw-on-path,.cw-is-origin,.cw-is-at").forEach(function(r){
r.classList.remove("cw-on-path","cw-is-origin","cw-is-at");});
findings.forEach(function(f){f.classList.remove("cw-selected");});}
function select(f){var path=JSON.parse(f.getAttribute("data-path")||"[]");if(!path.length)return;clear();
f.classList.add("cw-selected");var origin=f.getAttribute("data-origin");var at=f.getAttribute("data-module");
var search=root.querySelector(".cw-search");if(search&&search.value){search.value="";filter("");}
path.forEach(function(name){if(!byName[name])return;reveal(name);rowOf(byName[name]).classList.add("cw-on-path");});
var target=byName[origin]?origin:at;if(byName[at])rowOf(byName[at]).classList.add("cw-is-at");
if(byName[origin])rowOf(byName[origin]).classList.add("cw-is-origin");
if(bar)bar.textContent=f.getAttribute("data-code")+": "+path.map(function(n){return n||"(model)";}).join(" \\u2192 ");
var row=byName[target]&&rowOf(byName[target]);if(row&&row.scrollIntoView)row.scrollIntoView({block:"center"});}
findings.forEach(function(f){f.addEventListener("click",function(){select(f);});
f.addEventListener("keydown",function(e){if(e.key==="Enter"||e.key===" "){e.preventDefault();select(f);}});});
root.querySelectorAll(".cw-pin").forEach(function(p){p.addEventListener("click",function(e){e.preventDefault();
e.stopPropagation();var f=findings[+p.getAttribute("data-finding")];if(f){select(f);
if(f.scrollIntoView)f.scrollIntoView({block:"nearest"});}});});
function filter(q){q=q.trim().toLowerCase();var count=root.querySelector(".cw-count");
if(!q){nodes.forEach(function(n){n.hidden=false;n.classList.remove("cw-hit");});if(count)count.textContent="";return;}
var keep={};var hits=0;nodes.forEach(function(n){var name=n.getAttribute("data-node");
var hit=(name||"(model)").toLowerCase().indexOf(q)>=0||n.getAttribute("data-type").toLowerCase().indexOf(q)>=0;
n.classList.toggle("cw-hit",hit);if(hit){hits++;var a=name;keep[a]=1;while(a!==""){a=parentOf(a);keep[a]=1;}}});
nodes.forEach(function(n){var k=!!keep[n.getAttribute("data-node")];n.hidden=!k;if(k&&n.tagName==="DETAILS")
n.open=true;});if(count)count.textContent=hits+" match"+(hits===1?"":"es");}
var input=root.querySelector(".cw-search");if(input)input.addEventListener("input",function(){filter(input.value);});
function setAll(open){nodes.forEach(function(n){if(n.tagName==="DETAILS")n.open=open;});}
var ex=root.querySelector(".cw-expand");if(ex)ex.addEventListener("click",function(){setAll(true);});
var co=root.querySelector(".cw-collapse");if(co)co.addEventListener("click",function(){setAll(false);});
root.setAttribute("data-ready","1");
})();
"""
