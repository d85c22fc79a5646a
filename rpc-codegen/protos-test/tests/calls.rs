//! Calls every generated service over mem:// and tcp://.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::StreamExt;
use rpc_codegen_protos_test::acme::common::v1::{Availability, Item, Money, item};
use rpc_codegen_protos_test::acme::inventory::v1::{
    AddItemRequest, GetItemRequest, ItemList, SearchRequest,
    inventory_client::InventoryClient,
    inventory_server::{Inventory, InventoryServer},
    search_client::SearchClient,
    search_server::{Search, SearchServer},
};
use rpc_codegen_protos_test::plain::{
    PingMessage,
    pinger_client::PingerClient,
    pinger_server::{Pinger, PingerServer},
};
use rpc_core::{Channel, Code, Request, Response, Server, Status};

#[derive(Default)]
struct Store {
    items: Mutex<BTreeMap<String, Item>>,
    last_change: Mutex<Option<rpc_core::prost_types::Timestamp>>,
}

impl Store {
    fn touch(&self) {
        *self.last_change.lock().unwrap() = Some(rpc_core::prost_types::Timestamp {
            seconds: 1_700_000_000,
            nanos: 5,
        });
    }
}

impl Inventory for Store {
    type WatchItemsStream = futures_util::stream::Iter<std::vec::IntoIter<Result<Item, Status>>>;
    type RepriceStream =
        std::pin::Pin<Box<dyn futures_core::Stream<Item = Result<Item, Status>> + Send>>;

    async fn watch_items(
        &self,
        request: Request<GetItemRequest>,
    ) -> Result<Response<Self::WatchItemsStream>, Status> {
        let prefix = request.into_inner().sku;
        let mut matching: Vec<Result<Item, Status>> = self
            .items
            .lock()
            .unwrap()
            .values()
            .filter(|item| item.sku.starts_with(&prefix))
            .cloned()
            .map(Ok)
            .collect();
        if prefix == "fail" {
            matching.push(Err(Status::data_loss("watch broke after the items")));
        }
        Ok(Response::new(futures_util::stream::iter(matching)))
    }

    async fn upload(
        &self,
        request: Request<rpc_core::Streaming<Item>>,
    ) -> Result<Response<ItemList>, Status> {
        let mut items = request.into_inner();
        let mut added = Vec::new();
        while let Some(item) = items.message().await? {
            self.items
                .lock()
                .unwrap()
                .insert(item.sku.clone(), item.clone());
            added.push(item);
        }
        self.touch();
        Ok(Response::new(ItemList { items: added }))
    }

    async fn reprice(
        &self,
        request: Request<rpc_core::Streaming<Item>>,
    ) -> Result<Response<Self::RepriceStream>, Status> {
        let repriced = request.into_inner().map(|item| {
            let mut item = item?;
            item.pricing = Some(item::Pricing::FixedPrice(Money {
                currency_code: "EUR".into(),
                units: item.sku.len() as i64,
                nanos: 0,
            }));
            Ok(item)
        });
        Ok(Response::new(Box::pin(repriced)))
    }

    async fn add_item(&self, request: Request<AddItemRequest>) -> Result<Response<Item>, Status> {
        let item = request
            .into_inner()
            .item
            .ok_or_else(|| Status::invalid_argument("item is required"))?;
        let mut items = self.items.lock().unwrap();
        if items.contains_key(&item.sku) {
            return Err(Status::already_exists(format!("sku {} exists", item.sku)));
        }
        items.insert(item.sku.clone(), item.clone());
        drop(items);
        self.touch();
        Ok(Response::new(item))
    }

    async fn get_item(&self, request: Request<GetItemRequest>) -> Result<Response<Item>, Status> {
        let sku = request.into_inner().sku;
        self.items
            .lock()
            .unwrap()
            .get(&sku)
            .cloned()
            .map(Response::new)
            .ok_or_else(|| Status::not_found(sku))
    }

    async fn list_items(&self, _request: Request<()>) -> Result<Response<ItemList>, Status> {
        Ok(Response::new(ItemList {
            items: self.items.lock().unwrap().values().cloned().collect(),
        }))
    }

    async fn clear(&self, _request: Request<()>) -> Result<Response<()>, Status> {
        self.items.lock().unwrap().clear();
        self.touch();
        Ok(Response::new(()))
    }

    async fn last_change(
        &self,
        _request: Request<()>,
    ) -> Result<Response<rpc_core::prost_types::Timestamp>, Status> {
        self.last_change
            .lock()
            .unwrap()
            .map(Response::new)
            .ok_or_else(|| Status::failed_precondition("no change yet"))
    }
}

struct Finder;

impl Search for Finder {
    async fn r#match(&self, request: Request<SearchRequest>) -> Result<Response<ItemList>, Status> {
        let request = request.into_inner();
        let item = Item {
            sku: request.query,
            kind: request.kind,
            ..Default::default()
        };
        Ok(Response::new(ItemList { items: vec![item] }))
    }
}

struct Echoer;

impl Pinger for Echoer {
    async fn ping(&self, request: Request<PingMessage>) -> Result<Response<PingMessage>, Status> {
        Ok(Response::new(PingMessage {
            sequence: request.into_inner().sequence + 1,
        }))
    }
}

fn sample_item(sku: &str) -> Item {
    Item {
        sku: sku.into(),
        name: "Widget".into(),
        kind: item::Kind::Physical as i32,
        availability: Availability::Backorder as i32,
        dimensions: Some(item::Dimensions {
            width_mm: 10,
            height_mm: 20,
            depth_mm: 30,
        }),
        pricing: Some(item::Pricing::FixedPrice(Money {
            currency_code: "EUR".into(),
            units: 12,
            nanos: 500_000_000,
        })),
        labels: [("color".to_owned(), "red".to_owned())]
            .into_iter()
            .collect(),
        tags: vec!["new".into(), "sale".into()],
        created_at: Some(rpc_core::prost_types::Timestamp {
            seconds: 1,
            nanos: 2,
        }),
        #[allow(deprecated)]
        // `bytes` fields are `bytes::Bytes` by default.
        thumbnail: bytes::Bytes::from_static(&[1, 2, 3]),
    }
}

async fn serve(listen: &str) -> rpc_core::transport::Endpoint {
    let listening = Server::builder()
        .add_service(InventoryServer::new(Store::default()))
        .add_service(SearchServer::new(Finder))
        .add_service(PingerServer::new(Echoer))
        .listen(listen)
        .await
        .unwrap();
    let endpoint = listening.local_endpoint();
    tokio::spawn(listening.serve());
    endpoint
}

async fn exercise(endpoint: rpc_core::transport::Endpoint) {
    let mut inventory = InventoryClient::connect(endpoint.clone()).await.unwrap();

    let status = inventory.last_change(()).await.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition);

    let added = inventory
        .add_item(AddItemRequest {
            item: Some(sample_item("A-1")),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(added, sample_item("A-1"));
    let status = inventory
        .add_item(AddItemRequest {
            item: Some(sample_item("A-1")),
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::AlreadyExists);
    let status = inventory
        .add_item(AddItemRequest { item: None })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);

    #[allow(deprecated)]
    let fetched = inventory
        .get_item(GetItemRequest { sku: "A-1".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched.pricing, sample_item("A-1").pricing);
    assert_eq!(fetched.labels.get("color").map(String::as_str), Some("red"));
    assert_eq!(fetched.dimensions.unwrap().depth_mm, 30);

    inventory
        .add_item(Request::new(AddItemRequest {
            item: Some(sample_item("B-2")),
        }))
        .await
        .unwrap();
    let listed = inventory.list_items(()).await.unwrap().into_inner();
    assert_eq!(
        listed
            .items
            .iter()
            .map(|i| i.sku.as_str())
            .collect::<Vec<_>>(),
        ["A-1", "B-2"]
    );
    assert_eq!(
        inventory.last_change(()).await.unwrap().into_inner().nanos,
        5
    );
    // Server streaming: the items of a prefix, then the end.
    let mut watched = inventory
        .watch_items(GetItemRequest { sku: "A".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(watched.message().await.unwrap().unwrap().sku, "A-1");
    assert_eq!(watched.message().await.unwrap(), None);
    // An error after the messages arrives after them.
    let mut failing = inventory
        .watch_items(GetItemRequest { sku: "fail".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(failing.message().await.unwrap_err().code(), Code::DataLoss);
    // Client streaming: any Stream of messages.
    let uploaded = inventory
        .upload(futures_util::stream::iter([
            sample_item("C-3"),
            sample_item("D-4"),
        ]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(uploaded.items.len(), 2);
    assert_eq!(
        inventory
            .list_items(())
            .await
            .unwrap()
            .into_inner()
            .items
            .len(),
        4
    );
    // Bidirectional: each answer comes while the request stream is open.
    let (sender, mut receiver) = tokio::sync::mpsc::unbounded_channel();
    let mut repriced = inventory
        .reprice(Request::new(futures_util::stream::poll_fn(move |cx| {
            receiver.poll_recv(cx)
        })))
        .await
        .unwrap()
        .into_inner();
    for sku in ["E", "FF", "GGG"] {
        sender.send(sample_item(sku)).unwrap();
        let item = repriced.message().await.unwrap().unwrap();
        assert_eq!(item.sku, sku);
        assert_eq!(
            item.pricing,
            Some(item::Pricing::FixedPrice(Money {
                currency_code: "EUR".into(),
                units: sku.len() as i64,
                nanos: 0,
            }))
        );
    }
    drop(sender);
    assert_eq!(repriced.message().await.unwrap(), None);

    inventory.clear(()).await.unwrap();
    assert!(
        inventory
            .list_items(())
            .await
            .unwrap()
            .into_inner()
            .items
            .is_empty()
    );

    // The client works through a tower stack as well.
    let channel = Channel::connect(endpoint.clone()).await.unwrap();
    let stack = tower::ServiceBuilder::new()
        .timeout(Duration::from_secs(5))
        .service(channel.clone());
    let mut search = SearchClient::new(stack);
    let found = search
        .r#match(SearchRequest {
            query: "lamp".into(),
            kind: item::Kind::Digital as i32,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(found.items[0].sku, "lamp");
    assert_eq!(found.items[0].kind(), item::Kind::Digital);

    let mut pinger = PingerClient::new(channel.clone());
    assert_eq!(
        pinger
            .ping(PingMessage { sequence: 41 })
            .await
            .unwrap()
            .into_inner()
            .sequence,
        42
    );
    // The package-less service lives at /Pinger/Ping.
    let mut raw = Request::new(bytes::Bytes::new());
    raw.set_method("/Pinger/Ping");
    channel.unary(raw).await.unwrap();
}

#[tokio::test]
async fn generated_services_over_mem() {
    exercise(serve("mem://protos-test").await).await;
}

#[tokio::test]
async fn generated_services_over_tcp() {
    exercise(serve("tcp://127.0.0.1:0").await).await;
}

#[test]
fn clients_are_clone_when_their_service_is() {
    fn assert_clone<T: Clone>() {}
    assert_clone::<InventoryClient<Channel>>();
    assert_clone::<SearchClient<tower::timeout::Timeout<Channel>>>();
    assert_clone::<InventoryServer<Store>>();
}

#[test]
fn proto_comments_become_docs_and_every_rpc_is_generated() {
    let generated =
        std::fs::read_to_string(concat!(env!("OUT_DIR"), "/acme.inventory.v1.rs")).unwrap();
    assert!(
        generated.contains("/// Adds an item; ALREADY_EXISTS when the SKU is taken."),
        "{generated}"
    );
    assert!(generated.contains("/// Keeps track of items."));
    assert!(generated.contains("/// Items are identified by SKU."));
    assert!(generated.contains("\"/acme.inventory.v1.Inventory/AddItem\""));
    for rpc in [
        "fn watch_items",
        "fn upload",
        "fn reprice",
        "type WatchItemsStream",
    ] {
        assert!(generated.contains(rpc), "{rpc}: {generated}");
    }
    let plain = std::fs::read_to_string(concat!(env!("OUT_DIR"), "/_.rs")).unwrap();
    assert!(plain.contains("\"/Pinger/Ping\""));
}
